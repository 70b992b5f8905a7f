"""Result tables: one row per configuration, with the knobs and what the simulator found.

Columns (see :data:`COLUMNS` for types):

* ``config_id``: a stable hash of the knobs (:func:`search.space.config_id`).
* the knobs of :class:`search.space.Config`.
* ``status``: ``"ok"``, ``"out of memory"`` (simulated; the peak exceeds the
  preset's memory on some device) or ``"invalid"`` (not simulated); ``reason``
  says why a row is not ok.
* ``step_time_s``: seconds per training step; ``throughput_samples_per_s``:
  ``global_batch_size / step_time_s``.
* ``model_tflops_per_gpu``: the model's FLOPs per step
  (:func:`distir_jax.models.flops.model_flops_per_sample` times the batch: its
  forward and backward matmuls, not what recomputation adds) per second and
  GPU, in TFLOP/s; ``mfu``: model FLOPs utilization, the same over the GPUs'
  datasheet peak FLOP/s in the row's dtype (0.45 is 45%; a calibrated
  preset's datasheet peak is its base preset's, as a measured run's MFU is).
* ``peak_memory_bytes`` / ``peak_memory_gb``: the largest per-device peak.
* ``compute_time_s``, ``communication_time_s``, ``bubble_time_s``: the
  breakdown on the *busiest* device (the one with the most busy seconds,
  summed over its streams): seconds running compute ops, seconds in
  communication ops, and ``step_time_s`` minus the busy seconds of that
  device's busiest stream (time that stream idles: pipeline bubbles and
  waiting on other devices). With one stream per device the three add up to
  the step time; with a communication stream, overlapped communication makes
  the sum exceed it.
* ``simulated_ops``: ops in the (symmetry-reduced) program that was simulated.
* ``engine``: ``"exact"`` or ``"fast"`` (see :func:`search.evaluate`); empty when nothing ran.

Invalid rows are never NaN: their step time is ``inf``, and throughput,
utilization, memory and breakdown are 0, so sorting never favours them; filter by
``status``.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from search.space import Config

STATUS_OK = "ok"
STATUS_OOM = "out of memory"
STATUS_INVALID = "invalid"

_KNOB_TYPES = {
    "model": str,
    "hardware": str,
    "world_size": int,
    "global_batch_size": int,
    "seq_len": int,
    "data": int,
    "tensor": int,
    "pipeline": int,
    "microbatches": int,
    "microbatch_size": int,
    "schedule": str,
    "virtual_stages": int,
    "recompute": str,
    "zero": bool,
    "sequence_parallel": bool,
    "overlap_grad_comm": bool,
    "dtype": str,
    "training_precision": str,
    "optimizer": str,
}
# Column name -> Python type, in table order.
COLUMNS: dict[str, type] = {
    "config_id": str,
    **_KNOB_TYPES,
    "status": str,
    "reason": str,
    "step_time_s": float,
    "throughput_samples_per_s": float,
    "model_tflops_per_gpu": float,
    "mfu": float,
    "peak_memory_bytes": float,
    "peak_memory_gb": float,
    "compute_time_s": float,
    "communication_time_s": float,
    "bubble_time_s": float,
    "simulated_ops": int,
    "engine": str,
}
METRICS = (
    "step_time_s",
    "throughput_samples_per_s",
    "model_tflops_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "peak_memory_gb",
    "compute_time_s",
    "communication_time_s",
    "bubble_time_s",
    "simulated_ops",
    "engine",
)
# Columns computed from the others and the configuration, added after files were
# written without them: a sweep resumed from such a file fills them in
# (:meth:`ResultTable.read`'s ``derive``).
DERIVED_COLUMNS = ("model_tflops_per_gpu", "mfu")
_NUMPY = {str: object, int: np.int64, float: np.float64, bool: np.bool_}


def _column(kind: type, values) -> np.ndarray:
    return np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=_NUMPY[kind])


def invalid_metrics() -> dict:
    """Metrics of a row that was not simulated (no NaN, see the module docstring)."""
    metrics = {m: (math.inf if m == "step_time_s" else 0) for m in METRICS}
    metrics["engine"] = ""  # nothing ran
    return metrics


class ResultTable:
    """Columns of equal length, one row per configuration, in a fixed column order."""

    def __init__(self, columns: Mapping[str, Iterable]):
        missing = [c for c in COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"a result table needs columns {missing}")
        self._columns = {name: _column(kind, columns[name]) for name, kind in COLUMNS.items()}
        lengths = {len(v) for v in self._columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns have different lengths: {sorted(lengths)}")

    # --- construction -------------------------------------------------------

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping]) -> ResultTable:
        return cls({name: [row[name] for row in rows] for name in COLUMNS})

    @classmethod
    def empty(cls) -> ResultTable:
        return cls({name: [] for name in COLUMNS})

    @staticmethod
    def row_for(config: Config, status: str, reason: str, metrics: Mapping) -> dict:
        """A row dict from a configuration, its status and metrics."""
        knobs = config.knobs()
        return {"config_id": config.config_id, **knobs, "status": status, "reason": reason, **metrics}

    @classmethod
    def concat(cls, tables: Sequence[ResultTable]) -> ResultTable:
        tables = list(tables)
        if not tables:
            return cls.empty()
        return cls({name: np.concatenate([t._columns[name] for t in tables]) for name in COLUMNS})

    # --- access -------------------------------------------------------------

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self._columns)

    def __len__(self) -> int:
        return len(self._columns["config_id"])

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._columns:
            raise KeyError(f"no column {name!r}; the columns are {list(COLUMNS)}")
        return self._columns[name]

    def row(self, i: int) -> dict:
        return {name: _python(col[i]) for name, col in self._columns.items()}

    def rows(self) -> list[dict]:
        return [self.row(i) for i in range(len(self))]

    def take(self, index) -> ResultTable:
        """Rows at ``index`` (integers or a boolean mask), in that order."""
        index = np.asarray(index)
        return ResultTable({name: col[index] for name, col in self._columns.items()})

    def where(self, **equal) -> ResultTable:
        """Rows whose columns equal the given values, e.g. ``where(status="ok")``.

        Raises:
          ValueError: for a name that is not a column (see :data:`COLUMNS`).
        """
        _check_columns("where", list(equal))
        mask = np.ones(len(self), bool)
        for name, value in equal.items():
            mask &= self._columns[name] == value
        return self.take(mask)

    def equals(self, other: ResultTable) -> bool:
        """Same rows in the same order, values equal (floats exactly)."""
        return len(self) == len(other) and all(
            np.array_equal(self._columns[n], other._columns[n]) for n in COLUMNS
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, ResultTable) and self.equals(other)

    __hash__ = None

    def __repr__(self) -> str:
        status = self._columns["status"]
        counts = {s: int(np.sum(status == s)) for s in (STATUS_OK, STATUS_OOM, STATUS_INVALID)}
        return f"ResultTable({len(self)} rows: {counts})"

    # --- queries ------------------------------------------------------------

    def top_k(self, k: int = 10, memory_limit: float | None = None) -> ResultTable:
        """The ``k`` ok rows of highest throughput, optionally under a memory limit.

        Args:
          k: how many rows at most (an int >= 0).
          memory_limit: bytes (a positive number), or None; rows whose peak
            per-device memory exceeds it are left out (the preset's capacity
            already excluded out-of-memory rows).

        Returns:
          Rows sorted by throughput (descending), then peak memory, then id.

        Raises:
          ValueError: for a ``k`` or ``memory_limit`` of another kind.
        """
        _check_k(k)
        _check_memory_limit(memory_limit)
        ok = self._columns["status"] == STATUS_OK
        if memory_limit is not None:
            ok &= self._columns["peak_memory_bytes"] <= memory_limit
        throughput, memory = self["throughput_samples_per_s"], self["peak_memory_bytes"]
        return self._first(k, np.flatnonzero(ok), -throughput, memory)

    def closest_to_fitting(self, k: int = 5, memory_limit: float | None = None) -> ResultTable:
        """The ``k`` simulated rows that miss a memory budget by the least: out of
        memory, or (with ``memory_limit``, bytes) ok but over it; least peak
        memory first, then highest throughput, then id. For when :meth:`top_k`
        is empty: how far the space is from fitting, and which knobs come closest.
        ``k`` and ``memory_limit`` are checked as :meth:`top_k` checks them."""
        _check_k(k)
        _check_memory_limit(memory_limit)
        status = self._columns["status"]
        over = status == STATUS_OOM
        if memory_limit is not None:
            over |= (status == STATUS_OK) & (self._columns["peak_memory_bytes"] > memory_limit)
        throughput, memory = self["throughput_samples_per_s"], self["peak_memory_bytes"]
        return self._first(k, np.flatnonzero(over), memory, -throughput)

    def _first(self, k: int, index: np.ndarray, *keys: np.ndarray) -> ResultTable:
        """Rows ``index``, at most ``k`` of them, sorted by ``keys`` (full columns, the
        first the most significant), then by ``config_id``."""
        order = np.lexsort((self._columns["config_id"][index].astype(str), *(x[index] for x in keys[::-1])))
        return self.take(index[order][: max(int(k), 0)])

    def reasons(self, status: str = STATUS_INVALID) -> list[tuple[str, int]]:
        """The reasons of the rows of ``status`` as ``(first such reason, rows)``,
        most common first: reasons that differ only in numbers are one kind
        (``microbatches=2`` and ``microbatches=4``), shown by the first row's."""
        kinds: dict[str, list] = {}
        for reason in self._columns["reason"][self._columns["status"] == status]:
            kind = kinds.setdefault(re.sub(r"\d+(\.\d+)?", "#", str(reason)), [str(reason), 0])
            kind[1] += 1
        return sorted(((example, rows) for example, rows in kinds.values()), key=lambda x: -x[1])

    def pareto_front(self) -> ResultTable:
        """Ok rows not dominated in (higher throughput, lower peak memory), by memory.

        A row is dominated when another ok row has at least its throughput and
        at most its memory, and is strictly better in one. Rows that tie
        exactly are all kept.
        """
        index = np.flatnonzero(self._columns["status"] == STATUS_OK)
        mem = self._columns["peak_memory_bytes"][index]
        thr = self._columns["throughput_samples_per_s"][index]
        order = np.lexsort((self._columns["config_id"][index].astype(str), -thr, mem))
        keep = []
        best = -math.inf  # best throughput among rows of strictly smaller memory
        i = 0
        while i < len(order):
            j = i  # rows i..j-1 share one memory value
            while j < len(order) and mem[order[j]] == mem[order[i]]:
                j += 1
            top = thr[order[i]]
            if top > best:
                keep.extend(int(index[order[r]]) for r in range(i, j) if thr[order[r]] == top)
                best = top
            i = j
        return self.take(np.asarray(keep, np.int64))

    # --- input / output -----------------------------------------------------

    def to_pandas(self):
        """A ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas: pip install pandas (or use to_csv / rows)") from None
        return pd.DataFrame({name: col for name, col in self._columns.items()})

    def to_csv(self, path) -> None:
        """Writes CSV with the csv module; floats use ``repr`` so they read back exactly."""
        _parent(path)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for i in range(len(self)):
                writer.writerow([_cell(self._columns[n][i], kind) for n, kind in COLUMNS.items()])

    def to_parquet(self, path) -> None:
        """Writes Parquet (needs pyarrow)."""
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("to_parquet needs pyarrow: pip install pyarrow (or use to_csv)") from None
        _parent(path)
        arrays = {
            n: pa.array(self._columns[n].tolist() if kind is str else self._columns[n])
            for n, kind in COLUMNS.items()
        }
        pq.write_table(pa.table(arrays), path)

    def write(self, path) -> None:
        """Writes CSV or Parquet, by the path's suffix."""
        if str(path).endswith(".parquet"):
            self.to_parquet(path)
        else:
            self.to_csv(path)

    @classmethod
    def read(cls, path, derive=None) -> ResultTable:
        """Reads a table written by :meth:`to_csv` or :meth:`to_parquet` (by suffix).

        ``derive``: for a file written before :data:`DERIVED_COLUMNS` were, a
        function from the file's columns to those it lacks (a resumed sweep's);
        without it such a file is an error.

        Raises:
          ValueError: naming the file, line and column of a value that does not
            parse, or of an ok row whose step time or throughput is not a
            positive finite number (a sweep writes none: the file was changed);
            or the columns a file lacks.
        """
        columns = cls.read_columns(path, COLUMNS)
        missing = [c for c in COLUMNS if c not in columns]
        if missing and derive is None:
            raise ValueError(
                f"{path}: not a results table of this version (missing {missing}; written by an "
                "older distir-jax? sweep again, or resume the sweep: it fills them in)"
            )
        if missing:
            columns.update(derive(columns))
        table = cls(columns)
        ok = table["status"] == STATUS_OK
        for column in ("step_time_s", "throughput_samples_per_s"):
            values = table[column]
            bad = np.flatnonzero(ok & ~(np.isfinite(values) & (values > 0)))
            if bad.size:
                raise ValueError(
                    f"{path}: row {bad[0] + 1} ({table['config_id'][bad[0]]}) is ok with "
                    f"{column}={float(values[bad[0]])}; a sweep writes positive finite numbers there"
                )
        return table

    @staticmethod
    def read_columns(path, names: Iterable[str]) -> dict[str, list]:
        """Columns ``names`` of a results file (:meth:`read`'s values): a resumed
        sweep's ids cost a fraction of reading its file whole. A file written
        before :data:`DERIVED_COLUMNS` were has none of them: those are left out."""
        if str(path).endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ImportError("reading Parquet needs pyarrow; use a .csv results file") from None
            names = _present(names, pq.read_schema(path).names)
            table = pq.read_table(path, columns=names)
            return {n: table.column(n).to_pylist() for n in names}
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            expected, names = _present(COLUMNS, header or ()), _present(names, header or ())
            if header is None or [h for h in header if h in COLUMNS] != expected:
                missing = [c for c in expected if c not in (header or ())]
                older = " (written by an older distir-jax? sweep again without resuming it)" if header else ""
                raise ValueError(
                    f"{path}: not a results table (expected columns {list(COLUMNS)}"
                    + (f"; missing {missing}" if header and missing else "")
                    + f"){older}"
                )
            where = [(name, header.index(name), COLUMNS[name]) for name in names]
            values = {name: [] for name in names}
            for number, line in enumerate(reader, start=2):
                if len(line) != len(header):  # a line cut short (a copy interrupted, say)
                    raise ValueError(
                        f"{path}, line {number}: {len(line)} fields where the header has {len(header)}"
                    )
                for name, at, kind in where:
                    try:
                        values[name].append(_parse(line[at], kind))
                    except ValueError:
                        raise ValueError(
                            f"{path}, line {number}: {name}={line[at]!r} is not a {kind.__name__}"
                        ) from None
        return values

    def display_columns(self) -> list[str]:
        """:meth:`format`'s default columns: :data:`DISPLAY_COLUMNS`, and each knob of
        :data:`VARYING_COLUMNS` that takes more than one value in this table. Pass
        a whole sweep's to its top rows' :meth:`format`, so that a knob the sweep
        varies shows even where those rows agree on it (all sequence parallel, say)."""
        varying = {c for c in VARYING_COLUMNS if len(set(self._columns[c].tolist())) > 1}
        columns = [c for c in VARYING_COLUMNS if c in varying and c != "sequence_parallel"]
        for c in DISPLAY_COLUMNS:
            columns.append(c)
            if c == "zero" and "sequence_parallel" in varying:  # with the other switches
                columns.append("sequence_parallel")
        return columns

    def format(self, columns: Sequence[str] | None = None, limit: int | None = None) -> str:
        """A plain-text table of some columns (for terminals). By default
        :data:`DISPLAY_COLUMNS`, and each knob of :data:`VARYING_COLUMNS` that takes
        more than one value in this table: otherwise rows that differ only in it
        (bf16 and f16, say) would print alike.

        Args:
          columns: column names, or one name; None: the default above.
          limit: the first rows to print (an int >= 0; 0: the header only), or
            None for every row.

        Raises:
          ValueError: for a name that is not a column, or a ``limit`` of another kind.
        """
        if isinstance(columns, str):  # one column, not its letters
            columns = [columns]
        if columns is not None:
            columns = list(columns)
            _check_columns("columns", columns)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0
        ):
            raise ValueError(f"limit must be None or an int >= 0 (0: the header only), got {limit!r}")
        if columns is None:
            columns = self.display_columns()
        shown = len(self) if limit is None else min(len(self), int(limit))
        rows = [[_show(self._columns[c][i], c) for c in columns] for i in range(shown)]
        header = [DISPLAY_NAMES.get(c, c) for c in columns]
        widths = [max([len(h)] + [len(r[j]) for r in rows]) for j, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(lines)


DISPLAY_COLUMNS = (
    "data",
    "tensor",
    "pipeline",
    "microbatches",
    "schedule",
    "virtual_stages",
    "recompute",
    "zero",
    "overlap_grad_comm",
    "global_batch_size",
    "step_time_s",
    "throughput_samples_per_s",
    "mfu",
    "peak_memory_gb",
    "compute_time_s",
    "communication_time_s",
    "bubble_time_s",
)
# Knobs :meth:`ResultTable.format` shows only where they vary (most sweeps fix them).
VARYING_COLUMNS = ("model", "hardware", "dtype", "training_precision", "optimizer", "sequence_parallel")
DISPLAY_NAMES = {
    "microbatches": "mb",
    "global_batch_size": "batch",
    "step_time_s": "step s",
    "throughput_samples_per_s": "samples/s",
    "mfu": "MFU",
    "peak_memory_gb": "peak GB",
    "compute_time_s": "compute s",
    "communication_time_s": "comm s",
    "bubble_time_s": "bubble s",
    "data": "d",
    "tensor": "t",
    "pipeline": "p",
    "virtual_stages": "v",
    "overlap_grad_comm": "overlap",
    "sequence_parallel": "seq par",
}


def _present(names: Iterable[str], in_file: Iterable[str]) -> list[str]:
    """``names`` but the :data:`DERIVED_COLUMNS` a file (its columns ``in_file``) lacks."""
    in_file = set(in_file)
    return [n for n in names if n in in_file or n not in DERIVED_COLUMNS]


def _check_columns(argument: str, names: Sequence) -> None:
    """Raises a ValueError naming ``argument`` for names that are not columns."""
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise ValueError(f"{argument}: unknown column(s) {unknown}; the columns are {list(COLUMNS)}")


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an int >= 0 (how many rows at most), got {k!r}")


def _check_memory_limit(memory_limit) -> None:
    """None, or a positive number of bytes (not NaN: no row would be under it)."""
    if memory_limit is None:
        return
    number = isinstance(memory_limit, (int, float, np.integer, np.floating)) and not isinstance(
        memory_limit, (bool, np.bool_)
    )
    if not (number and memory_limit > 0):  # NaN compares False too
        raise ValueError(f"memory_limit must be None or a positive number of bytes, got {memory_limit!r}")


def _python(value):
    return value.item() if isinstance(value, np.generic) else value


def _cell(value, kind) -> str:
    if kind is float:
        return repr(float(value))
    if kind is bool:
        return "true" if value else "false"
    return str(_python(value))


def _parse(text: str, kind):
    if kind is float:
        return float(text)
    if kind is int:
        return int(text)
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("true", "1")
    return text


def _show(value, column: str) -> str:
    value = _python(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if column == "throughput_samples_per_s":
            return f"{value:.1f}"
        if column == "peak_memory_gb":
            return f"{value:.2f}"
        if column == "mfu":
            return f"{value:.1%}"
        return f"{value:.4g}"
    return str(value)


def _parent(path) -> None:
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
