"""steps.parquet and collectives.parquet (``export.parquet_tables``) on the fixed two-rank session
(``synthetic_session``): DuckDB's per-rank GROUP BY gives back summary.json's per-rank steps and
mean step time, each collective is a row with its wait (hand-worked figures), and a missing pyarrow
is one line while the other exports are written. A recorded train.py run is queried the same way
in ``record/test_record_end_to_end.py``."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import duckdb
import pytest

from ddpwatch.export import exporters
from ddpwatch.export.parquet_tables import COLLECTIVE_COLUMNS, PARQUET_EXTRA, STEP_COLUMNS
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from synthetic_session import session_messages, waiting_ranks


def written(tmp_path: Path, **messages: Any) -> tuple[dict[str, Any], Path]:
    session = Session()
    ingest(session, session_messages(**messages))
    exporters.write_exports(session, tmp_path)
    return exporters.summary(session), tmp_path


def query(sql: str) -> list[tuple[Any, ...]]:
    return duckdb.sql(sql).fetchall()


def test_a_group_by_rank_gives_back_the_summarys_per_rank_steps_and_mean_step(tmp_path: Path) -> None:
    summary, out = written(tmp_path, steps=10)
    got = query(f"SELECT segment, rank, count(*), avg(step_ms) FROM '{out / 'steps.parquet'}' "
                "WHERE counted GROUP BY segment, rank ORDER BY segment, rank")
    expected = [(segment["index"], int(rank), figures["steps"], figures["step_ms_mean"])
                for segment in summary["segments"] for rank, figures in sorted(segment["per_rank"].items())]
    assert [(s, r, n) for s, r, n, _ in got] == [(s, r, n) for s, r, n, _ in expected]
    assert [mean for *_, mean in got] == pytest.approx([mean for *_, mean in expected], rel=1e-12)
    assert len(got) == 4  # two segments (simple, then bucket) of two ranks: the query is not vacuous


def test_every_step_of_every_rank_is_a_row_with_the_schema_documented(tmp_path: Path) -> None:
    _, out = written(tmp_path, steps=6)
    steps = duckdb.sql(f"SELECT * FROM '{out / 'steps.parquet'}'")
    assert steps.columns == [name for name, _, _ in STEP_COLUMNS]
    assert query(f"SELECT count(*), count(DISTINCT step), min(start_s) FROM '{out / 'steps.parquet'}'") == [(12, 6, 0.0)]
    collectives = duckdb.sql(f"SELECT * FROM '{out / 'collectives.parquet'}'")
    assert collectives.columns == [name for name, _, _ in COLLECTIVE_COLUMNS]
    # simple (steps 1-3): four all-reduces of 9 ms a step; bucket (4-6): b0 of 30 ms, b1 of 35 ms
    assert query(f"SELECT strategy, kind, count(*), round(avg(duration_ms), 6) FROM '{out / 'collectives.parquet'}' "
                 f"JOIN (SELECT DISTINCT step, strategy FROM '{out / 'steps.parquet'}') USING (step) "
                 "GROUP BY strategy, kind ORDER BY strategy") == [("bucket", "all_reduce", 12, 32.5), ("simple", "all_reduce", 24, 9.0)]


def test_a_calls_wait_is_its_duration_less_the_shortest_of_the_same_call(tmp_path: Path) -> None:
    """Rank 1's first all-reduce of each step starts 30 ms early (``waiting_ranks``): p0 of 39 ms
    against rank 0's 9 ms in the simple steps, b0 of 60 ms against 30 ms in the bucket ones. Rank 1
    waited 30 ms in each; every other call, on either rank, 0."""
    _, out = written(tmp_path, steps=4, edit=waiting_ranks(30.0))
    rows = query(f"SELECT step, rank, tag, round(wait_ms, 6) FROM '{out / 'collectives.parquet'}' WHERE wait_ms > 1e-9 ORDER BY step")
    assert rows == [(1, 1, "p0", 30.0), (2, 1, "p0", 30.0), (3, 1, "b0", 30.0), (4, 1, "b0", 30.0)]
    assert query(f"SELECT count(*) FROM '{out / 'collectives.parquet'}' WHERE wait_ms IS NULL") == [(0,)]
    assert query(f"SELECT rank, round(sum(waited_for_others_ms), 6), round(sum(others_waited_ms), 6) "
                 f"FROM '{out / 'steps.parquet'}' GROUP BY rank ORDER BY rank") == [(0, 0.0, 120.0), (1, 120.0, 0.0)]


def test_without_pyarrow_the_tables_are_one_line_naming_the_extra_and_the_rest_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_pyarrow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    session = Session()
    ingest(session, session_messages(steps=4))
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    said: list[str] = []
    paths = exporters.write_exports(session, tmp_path, on_error=said.append)
    assert said == [PARQUET_EXTRA]
    assert PARQUET_EXTRA == "steps.parquet and collectives.parquet need pyarrow, the parquet extra: pip install 'ddpwatch[parquet]'"
    assert sorted(paths) == ["summary.csv", "summary.json", "summary.md", "summary.svg", "trace.json"]


def test_the_docs_page_lists_every_column_with_its_type_and_meaning() -> None:
    page = (Path(__file__).parents[3] / "docs" / "guide" / "parquet.md").read_text()
    for title, columns in (("## steps.parquet", STEP_COLUMNS), ("## collectives.parquet", COLLECTIVE_COLUMNS)):
        table = page.split(title, 1)[1].split("\n## ", 1)[0]
        rows = [line for line in table.splitlines() if line.startswith("| `")]
        assert rows == [f"| `{name}` | {kind} | {meaning} |" for name, kind, meaning in columns]
