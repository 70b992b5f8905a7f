"""Sweep manifests: which configurations a results file is to hold.

A results file grows as its sweep runs (checkpoints), so its length alone
cannot say whether the sweep finished: a part of a sweep stopped with every
other one (a job's time limit) looks like a complete part. Before its first
row, :func:`~search.evaluate` writes next to ``results/sweep.part-2-of-4.csv``
the manifest ``results/sweep.part-2-of-4.manifest.json``: the sweep's size,
this file's slice of it, and the ids of the configurations that slice holds.
``distir-jax merge`` checks each file it joins against its manifest
(:func:`manifest_gap`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

__all__ = ["RESUME_ADVICE", "manifest_gap", "manifest_path", "manifest_sweep", "write_manifest"]

# What a warning about a results file cut short tells its reader to do.
RESUME_ADVICE = "finish it with its `distir-jax sweep` options and --resume"


def manifest_path(results_path: str | os.PathLike) -> str:
    """The manifest of a results file: ``results/sweep.part-2-of-4.csv`` ->
    ``results/sweep.part-2-of-4.manifest.json`` (shared by its .parquet copy)."""
    return os.path.splitext(os.fspath(results_path))[0] + ".manifest.json"


def write_manifest(results_path: str | os.PathLike, configs: Sequence, index: int, count: int) -> None:
    """Records that ``results_path`` is to hold slice ``index`` of ``count`` of
    ``configs`` (``configs[index::count]``, as :func:`~search.evaluate` takes it)."""
    manifest = {
        # Which sweep the slice is of (every part's manifest names the same one), so
        # merge can tell parts of two sweeps, of one size, apart.
        "sweep": hashlib.sha1(" ".join(c.config_id for c in configs).encode()).hexdigest()[:16],
        "configurations": len(configs),
        "part": index,
        "parts": count,
        "config_ids": [c.config_id for c in configs[index::count]],
    }
    path = manifest_path(results_path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # as the results file's own writer does
    with open(path, "w") as f:
        json.dump(manifest, f)


def manifest_gap(results_path: str | os.PathLike, table) -> tuple[bool, str]:
    """``(checked, warning)``: whether the results file (read as ``table``) was
    checked against its manifest (it has one that reads), and a warning when
    it lacks configurations the manifest lists, or when the manifest does not
    read (``""`` when neither)."""
    path, manifest = os.fspath(results_path), manifest_path(results_path)
    if not os.path.exists(manifest):
        return False, ""
    try:
        with open(manifest) as f:
            wanted = {str(x) for x in json.load(f)["config_ids"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return (
            False,
            f"{manifest} is not a sweep manifest ({type(err).__name__}: {err}); "
            f"{path} not checked against it",
        )
    missing = len(wanted - set(table["config_id"].tolist()))
    if not missing:
        return True, ""
    return True, (
        f"{path} lacks {missing} of the {len(wanted)} configurations its sweep assigned it "
        f"({manifest}): was it interrupted? {RESUME_ADVICE}"
    )


def manifest_sweep(results_path: str | os.PathLike) -> str | None:
    """The sweep a results file's manifest says it is part of (its id, or for a
    manifest written before sweeps had one, its size), or None without a
    manifest that reads."""
    try:
        with open(manifest_path(results_path)) as f:
            manifest = json.load(f)
        return str(manifest.get("sweep") or f"{int(manifest['configurations'])} configurations")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
