"""Sweep manifests: which configurations a results file is to hold.

A results file grows as its sweep runs (checkpoints), so its length alone
cannot say whether the sweep finished: a part of a sweep stopped with every
other one (a job's time limit) looks like a complete part. Before its first
row, :func:`~search.evaluate` writes next to ``results/sweep.part-2-of-4.csv``
the manifest ``results/sweep.part-2-of-4.manifest.json``: the sweep's size,
this file's slice of it, and the ids of the configurations that slice holds.
``distir-jax merge`` checks each file it joins against its manifest
(:func:`manifest_gap`).

A configuration's id names its model and hardware, not what they were when
its row was computed: a model of one's own (``--models``) or a calibrated
preset (``--presets``) may be redefined under the same name. So the manifest
also records the definitions its rows were computed with (:func:`sweep_inputs`:
each model's sizes, a digest of each hardware's devices and links), and a
resumed sweep, or a merge, whose definitions differ is an error that names
what changed (:func:`changed_inputs`) rather than a table mixing both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

__all__ = [
    "RESUME_ADVICE",
    "changed_inputs",
    "manifest_gap",
    "manifest_path",
    "manifest_sweep",
    "merged_inputs",
    "recorded_inputs",
    "sweep_inputs",
    "write_manifest",
]

# What a warning about a results file cut short tells its reader to do.
RESUME_ADVICE = "finish it with its `distir-jax sweep` options and --resume"


def manifest_path(results_path: str | os.PathLike) -> str:
    """The manifest of a results file: ``results/sweep.part-2-of-4.csv`` ->
    ``results/sweep.part-2-of-4.manifest.json`` (shared by its .parquet copy)."""
    return os.path.splitext(os.fspath(results_path))[0] + ".manifest.json"


def write_manifest(
    results_path: str | os.PathLike, configs: Sequence, index: int, count: int, inputs: dict | None = None
) -> None:
    """Records that ``results_path`` is to hold slice ``index`` of ``count`` of
    ``configs`` (``configs[index::count]``, as :func:`~search.evaluate` takes it),
    computed with ``inputs`` (default: :func:`sweep_inputs` of ``configs``)."""
    manifest = {
        # Which sweep the slice is of (every part's manifest names the same one), so
        # merge can tell parts of two sweeps, of one size, apart.
        "sweep": hashlib.sha1(" ".join(c.config_id for c in configs).encode()).hexdigest()[:16],
        "configurations": len(configs),
        "part": index,
        "parts": count,
        "config_ids": [c.config_id for c in configs[index::count]],
        "inputs": sweep_inputs(configs) if inputs is None else inputs,
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


def sweep_inputs(configs: Sequence) -> dict:
    """The definitions behind ``configs``' names, as a manifest records them:
    ``{"models": {name: sizes}, "hardware": {"preset (dtype)": digest}}``.

    A model is recorded by the fields of its definition (so an error can say
    which changed), a hardware by a digest of its devices' speeds and memory
    and of its links in the rows' dtype (its preset and calibration decide
    them). Names that do not resolve (rows invalid for that reason) are left out."""
    from distir_jax.models import get_model_config
    from search.space import HARDWARE_DTYPE

    models, hardware = {}, {}
    for name in sorted({c.model for c in configs}):
        try:
            config = get_model_config(name)
        except ValueError:  # a model given by its fields, not a name: its label says all
            continue
        models[name] = _json({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    # One configuration per (preset, dtype): its topology is theirs (cached).
    each = {(c.preset, HARDWARE_DTYPE.get(c.dtype, c.dtype)): c for c in configs}
    for (preset, dtype), config in sorted(each.items(), key=lambda item: item[0]):
        try:
            topology = config.topology()
        except ValueError:
            continue
        hardware[f"{preset} ({dtype})"] = _topology_digest(topology)
    return {"models": models, "hardware": hardware}


def _json(value):
    """``value`` as JSON gives it back (tuples as lists), so recorded and current compare equal."""
    return json.loads(json.dumps(value, default=str))


def _topology_digest(topology) -> str:
    """16 hex digits of SHA-1 over every figure of a topology (not its name)."""
    digest = hashlib.sha1()
    for field in dataclasses.fields(topology):
        if field.name != "name":
            digest.update(np.ascontiguousarray(getattr(topology, field.name), np.float64).tobytes())
    return digest.hexdigest()[:16]


def recorded_inputs(results_path: str | os.PathLike) -> dict | None:
    """What a results file's manifest says its rows were computed with
    (:func:`sweep_inputs`), or None: no manifest, one that does not read, or one
    written before manifests recorded it."""
    try:
        with open(manifest_path(results_path)) as f:
            inputs = json.load(f)["inputs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kinds = ("models", "hardware")
    readable = isinstance(inputs, dict) and all(isinstance(inputs.get(k), dict) for k in kinds)
    return inputs if readable else None


def changed_inputs(recorded: dict | None, current: dict) -> list[str]:
    """What ``current`` defines differently from ``recorded`` under the same
    names (both as :func:`sweep_inputs` gives them), one phrase per model or
    hardware, e.g. ``"model 'my-gpt' (hidden 4096 -> 5120)"``; names only one
    of them has are not compared."""
    if recorded is None:
        return []
    out = []
    for name, now in current["models"].items():
        then = recorded["models"].get(name)
        if not isinstance(then, dict):
            continue
        # Fields one side lacks are a newer distir-jax's, at the value that keeps the old meaning.
        fields = [f for f in sorted(set(then) & set(now)) if then[f] != now[f]]
        if fields:
            out.append(f"model {name!r} ({', '.join(f'{f} {then[f]} -> {now[f]}' for f in fields)})")
    for name, now in current["hardware"].items():
        then = recorded["hardware"].get(name)
        if then is not None and then != now:
            out.append(f"hardware {name} (other device or link figures: a recalibrated preset?)")
    return out


def merged_inputs(recorded: dict | None, current: dict) -> dict:
    """``current`` plus what ``recorded`` defines that it does not (the rows of a
    resumed file's other models and hardware stay in it)."""
    if recorded is None:
        return current
    return {kind: {**recorded[kind], **current[kind]} for kind in ("models", "hardware")}
