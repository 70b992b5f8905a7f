"""Result tables: ranking, Pareto fronts and file round trips on hand-made tables."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from search import COLUMNS, ResultTable
from search.results import invalid_metrics


def make_table(rows):
    """A table from ``(status, throughput, peak_bytes)`` triples; other columns filled in."""
    full = []
    for i, (status, throughput, peak) in enumerate(rows):
        row = {name: (kind() if kind is not bool else False) for name, kind in COLUMNS.items()}
        row.update(
            config_id=f"id{i:03d}",
            model="mlp-xs",
            hardware="dgx-a100-80gb",
            world_size=4,
            global_batch_size=64,
            data=i,
            status=status,
            reason="" if status == "ok" else "why",
        )
        if status == "invalid":
            row.update(invalid_metrics())
        else:
            row.update(
                throughput_samples_per_s=throughput,
                step_time_s=64 / throughput,
                peak_memory_bytes=peak,
                peak_memory_gb=peak / 1e9,
            )
        full.append(row)
    return ResultTable.from_rows(full)


HAND_MADE = make_table(
    [
        ("ok", 100.0, 10e9),  # 0: front (least memory)
        ("ok", 90.0, 20e9),  # 1: dominated by 0
        ("ok", 300.0, 30e9),  # 2: front
        ("out of memory", 900.0, 90e9),  # 3: never ranked
        ("ok", 300.0, 30e9),  # 4: ties 2 exactly: front too
        ("ok", 250.0, 30e9),  # 5: same memory as 2, slower: dominated
        ("invalid", 0.0, 0.0),  # 6: never ranked
        ("ok", 500.0, 60e9),  # 7: front
        ("ok", 500.0, 70e9),  # 8: dominated by 7
    ]
)


def test_top_k_ranks_ok_rows_by_throughput():
    top = HAND_MADE.top_k(4)
    assert top["data"].tolist() == [7, 8, 2, 4]
    assert HAND_MADE.top_k(100)["status"].tolist() == ["ok"] * 7
    assert len(HAND_MADE.top_k(0)) == 0


def test_top_k_memory_limit_is_inclusive():
    assert HAND_MADE.top_k(3, memory_limit=30e9)["data"].tolist() == [2, 4, 5]
    assert len(HAND_MADE.top_k(3, memory_limit=1e9)) == 0


def test_closest_to_fitting_ranks_rows_over_the_budget_by_peak_memory():
    assert HAND_MADE.closest_to_fitting()["data"].tolist() == [3]  # the one out of memory row
    # Under 25 GB: ok rows over it too, least memory first, then higher throughput, then id.
    assert HAND_MADE.closest_to_fitting(4, memory_limit=25e9)["data"].tolist() == [2, 4, 5, 7]
    assert HAND_MADE.closest_to_fitting(100, memory_limit=25e9)["data"].tolist() == [2, 4, 5, 7, 8, 3]
    assert len(HAND_MADE.closest_to_fitting(0)) == 0
    assert len(make_table([("ok", 1.0, 1e9), ("invalid", 0.0, 0.0)]).closest_to_fitting()) == 0


def test_reasons_group_reasons_that_differ_in_numbers_only():
    table = make_table([("invalid", 0.0, 0.0)] * 4 + [("ok", 1.0, 1e9)])
    reasons = ["pipeline=2 needs 4 layers", "pipeline=3 needs 6 layers", "bad dtype"]
    reasons.append("pipeline=4 needs 8 layers")
    columns = {name: table[name] for name in table.columns}
    columns["reason"] = np.asarray(reasons + [""], object)
    table = ResultTable(columns)
    assert table.reasons() == [("pipeline=2 needs 4 layers", 3), ("bad dtype", 1)]
    assert table.reasons("ok") == [("", 1)]


def test_pareto_front_on_hand_made_table():
    front = HAND_MADE.pareto_front()
    assert front["data"].tolist() == [0, 2, 4, 7]


def brute_force_front(table):
    ok = np.flatnonzero(table["status"] == "ok")
    thr, mem = table["throughput_samples_per_s"], table["peak_memory_bytes"]
    keep = []
    for i in ok:
        dominated = any(
            thr[j] >= thr[i] and mem[j] <= mem[i] and (thr[j] > thr[i] or mem[j] < mem[i]) for j in ok
        )
        if not dominated:
            keep.append(i)
    return set(table["config_id"][keep].tolist())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["ok", "ok", "out of memory", "invalid"]),
            st.integers(1, 6).map(float),
            st.integers(1, 6).map(lambda m: m * 1e9),
        ),
        min_size=0,
        max_size=25,
    )
)
def test_pareto_front_matches_brute_force(rows):
    table = make_table(rows)
    front = table.pareto_front()
    assert set(front["config_id"].tolist()) == brute_force_front(table)
    assert list(front["peak_memory_bytes"]) == sorted(front["peak_memory_bytes"])


def test_invalid_rows_have_no_nan():
    for name in ("step_time_s", "throughput_samples_per_s", "peak_memory_bytes", "compute_time_s"):
        assert not np.isnan(HAND_MADE[name]).any()
    assert math.isinf(HAND_MADE["step_time_s"][6])


def test_csv_round_trip_is_exact(tmp_path):
    table = make_table([("ok", 1 / 3, 1e9 / 7), ("invalid", 0.0, 0.0)])
    table.to_csv(tmp_path / "r.csv")
    back = ResultTable.read(tmp_path / "r.csv")
    assert back == table
    assert back["step_time_s"][0] == table["step_time_s"][0]
    assert back.columns == tuple(COLUMNS)


def test_parquet_and_pandas(tmp_path):
    pytest.importorskip("pyarrow")
    pd = pytest.importorskip("pandas")
    HAND_MADE.to_parquet(tmp_path / "r.parquet")
    assert ResultTable.read(tmp_path / "r.parquet") == HAND_MADE
    frame = HAND_MADE.to_pandas()
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == list(COLUMNS) and len(frame) == 9


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_some_columns_read_as_the_whole_table_has_them(tmp_path, suffix):
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    path = tmp_path / f"r.{suffix}"
    HAND_MADE.write(path)
    some = ResultTable.read_columns(path, ["config_id", "step_time_s", "zero"])
    assert list(some) == ["config_id", "step_time_s", "zero"]
    for name, values in some.items():
        assert values == HAND_MADE[name].tolist(), name


def test_read_rejects_other_files(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a results table"):
        ResultTable.read(tmp_path / "x.csv")
    # A file from before a knob existed names what it lacks.
    HAND_MADE.write(tmp_path / "old.csv")
    lines = (tmp_path / "old.csv").read_text().splitlines()
    header = lines[0].split(",")
    at = header.index("training_precision")
    cut = [",".join(f for i, f in enumerate(line.split(",")) if i != at) for line in lines]
    (tmp_path / "old.csv").write_text("\n".join(cut) + "\n")
    with pytest.raises(ValueError, match=r"missing \['training_precision'\].*older distir-jax"):
        ResultTable.read(tmp_path / "old.csv")


def test_format_prints_a_header_and_rows():
    text = HAND_MADE.top_k(2).format()
    lines = text.splitlines()
    assert len(lines) == 3 and "samples/s" in lines[0] and "500.0" in lines[1]


def test_take_where_and_concat():
    ok = HAND_MADE.where(status="ok")
    assert len(ok) == 7
    both = ResultTable.concat([ok, HAND_MADE.where(status="invalid")])
    assert len(both) == 8 and both.row(7)["status"] == "invalid"


def test_progress_falls_back_to_a_plain_printer_without_tqdm(monkeypatch, capsys):
    import sys

    from search._progress import progress_bar

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = progress_bar(10, desc="sweep")
    bar.update(4)
    bar.close()
    err = capsys.readouterr().err
    assert "4/10 configurations" in err and "configurations/s" in err
    quiet = progress_bar(10, enabled=False)
    quiet.update(10)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_format_adds_the_knobs_that_vary_in_the_table():
    """Rows that differ only in dtype, optimizer, model, hardware or sequence
    parallelism would print alike: each such knob gets a column where it varies."""
    plain = HAND_MADE.top_k(3).format().splitlines()[0].split()
    assert plain[:4] == ["d", "t", "p", "mb"]  # one value of each: the usual columns
    columns = {name: HAND_MADE[name].copy() for name in HAND_MADE.columns}
    columns["dtype"] = np.array(["bf16", "f16"] * 4 + ["bf16"], object)
    columns["optimizer"] = np.array(["adam"] * 9, object)
    columns["sequence_parallel"] = np.arange(9) % 3 == 0
    text = ResultTable(columns).format()
    header = text.splitlines()[0].split()
    assert header[:2] == ["dtype", "d"] and "optimizer" not in header
    assert header[header.index("zero") + 1 : header.index("zero") + 4] == ["seq", "par", "overlap"]
    assert ResultTable(columns).format(columns=["data"]).splitlines()[0].split() == ["d"]
    # A sweep's top rows that agree on a knob the sweep varies still show it (as the CLI prints them).
    table = ResultTable(columns)
    agreeing = table.take(np.flatnonzero(columns["sequence_parallel"]))
    assert "seq" not in agreeing.format().splitlines()[0].split()
    header = agreeing.format(table.display_columns()).splitlines()[0].split()
    assert header == text.splitlines()[0].split()


def test_read_names_the_line_and_column_of_a_damaged_file(tmp_path):
    HAND_MADE.to_csv(tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    header = lines[0].split(",")

    def damaged(line: int, column: str, value: str):
        fields = lines[line].split(",")
        fields[header.index(column)] = value
        path = tmp_path / f"{column}.csv"
        path.write_text("\n".join(lines[:line] + [",".join(fields)] + lines[line + 1 :]) + "\n")
        return path

    with pytest.raises(ValueError, match=r"line 3: world_size='four' is not a int"):
        ResultTable.read(damaged(2, "world_size", "four"))
    with pytest.raises(ValueError, match=r"row 1 \(id000\) is ok with step_time_s=nan"):
        ResultTable.read(damaged(1, "step_time_s", "nan"))
    with pytest.raises(ValueError, match=r"row 3 \(id002\) is ok with throughput_samples_per_s=inf"):
        ResultTable.read(damaged(3, "throughput_samples_per_s", "inf"))
    cut = tmp_path / "cut.csv"
    cut.write_text("\n".join(lines[:-1] + [lines[-1][:10]]) + "\n")  # a copy interrupted mid-line
    expected = rf"line {len(lines)}: \d+ fields where the header has {len(COLUMNS)}"
    with pytest.raises(ValueError, match=expected):
        ResultTable.read(cut)
    # Rows that are not ok keep inf step times (an invalid row's) and read as before.
    assert ResultTable.read(tmp_path / "r.csv") == HAND_MADE


def test_unknown_columns_are_value_errors_listing_the_columns():
    with pytest.raises(
        ValueError, match=r"where: unknown column\(s\) \['bogus'\]; the columns are .*'config_id'"
    ):
        HAND_MADE.where(bogus=1)
    with pytest.raises(ValueError, match=r"columns: unknown column\(s\) \['bogus'\]; the columns are"):
        HAND_MADE.format(columns=["data", "bogus"])
    with pytest.raises(KeyError, match="the columns are"):
        HAND_MADE["bogus"]


def test_format_takes_one_column_name_and_a_limit_of_zero():
    assert HAND_MADE.format(columns="data").splitlines() == HAND_MADE.format(columns=["data"]).splitlines()
    assert HAND_MADE.format(columns="data").splitlines()[:2] == ["d", "0"]
    header_only = HAND_MADE.format(limit=0)  # once `limit or len(self)`: every row
    assert header_only.split() == HAND_MADE.format().splitlines()[0].split() and "\n" not in header_only
    assert len(HAND_MADE.format(limit=2).splitlines()) == 3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"limit must be None or an int >= 0"):
            HAND_MADE.format(limit=bad)


@pytest.mark.parametrize("query", ["top_k", "closest_to_fitting"])
@pytest.mark.parametrize("bad", [math.nan, "1e9", 0, -1.0, True, [1e9]])
def test_memory_limit_must_be_a_positive_number_or_none(query, bad):
    with pytest.raises(ValueError, match=r"memory_limit must be None or a positive number"):
        getattr(HAND_MADE, query)(5, memory_limit=bad)


@pytest.mark.parametrize("query", ["top_k", "closest_to_fitting"])
def test_k_must_be_a_count(query):
    for bad in (-1, 2.5, "3", None):
        with pytest.raises(ValueError, match=r"k must be an int >= 0"):
            getattr(HAND_MADE, query)(bad)
    assert len(getattr(HAND_MADE, query)(np.int64(1), memory_limit=np.float64(25e9))) == 1
