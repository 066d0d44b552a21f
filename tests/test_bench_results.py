"""Published benchmark results (docs/bench-results/): each names a commit of this repository
whose src/mlx_omnia it ran, byte for byte, and the tables in docs/benchmarks.md and README.md
are exactly what `python -m mlx_omnia.bench.results_file` generates from them."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mlx_omnia.bench import agent_replay, concurrency, measure, results_file
from mlx_omnia.bench import main as bench

REPORTS = results_file.load_all()
REPO = results_file.REPO


@cache
def digest_at(revision: str) -> str:
    return results_file.source_digest(results_file.commit_files(REPO, revision))


def test_the_generated_tables_are_current() -> None:
    for doc, text in results_file.generated(REPORTS).items():
        assert doc.read_text() == text, f"{doc} is stale: run python -m mlx_omnia.bench.results_file"


def test_results_are_published() -> None:
    assert REPORTS, "docs/bench-results/ holds no result"
    assert any(r["environment"]["backend"] == "cuda" for r in REPORTS)
    assert any(r["environment"]["backend"] == "cpu" for r in REPORTS)


@pytest.mark.parametrize("report", REPORTS, ids=[results_file.file_name(r) for r in REPORTS])
def test_each_result_ran_code_on_a_named_commit(report: dict[str, Any]) -> None:
    env = report["environment"]
    revision = str(env["mlx_omnia_revision"])
    assert not revision.endswith("-dirty"), revision
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{revision}^{{commit}}"],
                           check=False, timeout=30)
    assert known.returncode == 0, f"{revision} is not a commit of this repository"
    assert digest_at(revision) == env["source_sha256"], (
        f"the run's src/mlx_omnia is not {revision}'s"
    )
    assert (results_file.RESULTS_DIR / results_file.file_name(report)).is_file()


@pytest.mark.parametrize("report", REPORTS, ids=[results_file.file_name(r) for r in REPORTS])
def test_each_result_is_like_for_like_with_every_run(report: dict[str, Any]) -> None:
    options = report["options"]
    assert options["like_for_like"] is True
    if report["command"] == "interleaved":
        assert report["gate_passed"] is True, report["checks"]
        per_run = report["decode_ratio_per_run"].get("omnia", [])
        assert len(per_run) == options["runs"]
    if report["command"] == "concurrency":
        assert report["passed"] is True, report["problems"]
        for per_run in report["ratio_per_run"].values():
            assert len(per_run) == options["runs"]
    if report["command"] == "agent-replay":
        assert report["checks"]["passed"] is True, report["checks"]["problems"]


def test_the_tree_digest_equals_the_commits_for_the_same_files(tmp_path: Path) -> None:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
    files = results_file.commit_files(REPO, head)
    package = tmp_path / "src" / "mlx_omnia"
    for name, data in files:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    assert results_file.source_digest(results_file.tree_files(package)) == digest_at(head)
    (package / "extra.py").write_text("# not committed\n")
    assert results_file.source_digest(results_file.tree_files(package)) != digest_at(head)


def test_results_option_writes_a_named_file_the_tables_read(tmp_path: Path) -> None:
    out = io.StringIO()
    into = tmp_path / "results"
    assert bench.main(["interleaved", "--model", "tiny", "--prompt", "16", "--generate", "8",
                       "--runs", "2", "--bandwidth-mib", "8", "--results", str(into)], out=out) == 0
    (saved,) = into.glob("*.json")
    report = json.loads(saved.read_text())
    assert saved.name == results_file.file_name(report)
    assert "_tiny_bf16_p16-g8_interleaved.json" in saved.name
    assert "config" not in report["model"]
    table = results_file.interleaved_table([report])
    (row,) = table.splitlines()[2:]
    assert "| tiny | bf16, both arms | 16 / 8 | 2 |" in row
    ratios = report["decode_ratio_per_run"].get("omnia")
    if ratios:
        assert " / ".join(f"{v:.2f}" for v in ratios) in row


# A run's environment as the benches record it, on a CPU (a cuda backend would ask the card).
ENV = {"date": "2026-12-08T10:00:00+00:00", "mlx_omnia_revision": "abc1234",
       "backend": "cpu", "device_name": "AMD EPYC"}


def streams_run(n: int, arrivals: list[tuple[float, int]]) -> concurrency.Run:
    """n streams that each got 3 tokens at `arrivals` from 16-token prompts."""
    return concurrency.Run([concurrency.Stream(list(arrivals), "length") for _ in range(n)], 16 * n)


def concurrency_report(layers: int | None = None) -> dict[str, Any]:
    """Two runs at 1 and 2 streams, built by the bench's own report code. omnia: 100 and 400
    tok/s; mlx-lm: 25 then 40 tok/s at 1 stream (ratios 4 and 2.5), 40 at 2 (ratio 10); of the
    model's first `layers` layers when given."""
    args = argparse.Namespace(model="tiny", dtype="bfloat16", prompt=16, generate=3, runs=2,
                              seed=0, layers=layers)
    omnia = {1: [streams_run(1, [(0.010, 1), (0.020, 1), (0.030, 1)])] * 2,
             2: [streams_run(2, [(0.010, 1), (0.015, 1), (0.020, 1)])] * 2}
    mlx_lm = {1: [streams_run(1, [(0.020, 1), (0.060, 1), (0.100, 1)]),
                  streams_run(1, [(0.020, 1), (0.045, 1), (0.070, 1)])],
              2: [streams_run(2, [(0.020, 1), (0.070, 1), (0.120, 1)])] * 2}
    return concurrency._report(
        args, ENV, {}, "random tiny", (4, 64), None, measure.Sampling(),
        {"omnia": omnia, "mlx-lm": mlx_lm}, [["omnia", "mlx-lm"], ["mlx-lm", "omnia"]], [],
    )


def replay_report(*, server: bool = True) -> dict[str, Any]:
    """Three turns of 10, 22 and 34 prompt tokens in blocks of 4, each answered [100, 101],
    built by the bench's own report code; the cached arms are served 0, 12 and 24 tokens."""
    args = argparse.Namespace(model="tiny", dtype="bfloat16", context=40, answer=2, turns=3,
                              block_tokens=4, seed=0, layers=None)
    answer = [100, 101]
    prompts = [list(range(10))]
    for fresh in (range(20, 30), range(40, 50)):
        prompts.append([*prompts[-1], *answer, *fresh])
    firsts = {"uncached": (0.100, 0.200, 0.400), "cached-memory": (0.100, 0.050, 0.040),
              "cached-disk": (0.110, 0.060, 0.050), "mlx-lm-server": (0.150, 0.080, 0.100)}
    if not server:
        del firsts["mlx-lm-server"]
    turns = {
        arm: [agent_replay.Turn(first, first + 0.01, len(prompt),
                                0 if arm == "uncached" else cached, 2, "length", answer,
                                {"memory_blocks": 0, "disk_blocks": 3 * t, "hits": cached // 4})
              for t, (first, prompt, cached) in enumerate(zip(times, prompts, (0, 12, 24),
                                                              strict=True))]
        for arm, times in firsts.items()
    }
    skipped = {} if server else {"mlx-lm-server": "mlx_lm is not importable"}
    return agent_replay._report(args, ENV, {}, Path("tiny"), None, prompts, turns, skipped, [],
                                [list(firsts)] * 3)


def test_each_kind_is_saved_under_a_name_of_what_it_ran(tmp_path: Path) -> None:
    prefix = "2026-12-08_abc1234_cpu-amd-epyc_tiny_"
    for report, name in [
        (concurrency_report(), "q4g64-bf16_p16-g3_streams-1-2_concurrency.json"),
        (replay_report(), "bf16_context40-turns3-answer2-block4_agent-replay.json"),
    ]:
        saved = results_file.save(report, tmp_path)
        assert saved.name == prefix + name == results_file.file_name(report)
        assert json.loads(saved.read_text())["table"] == report["table"]


def test_a_cut_model_is_named_with_its_layers_in_the_file_and_the_tables(tmp_path: Path) -> None:
    report = concurrency_report(layers=1)
    assert report["options"]["layers"] == {"first": 1, "of": 2}
    saved = results_file.save(report, tmp_path)
    assert saved.name.endswith("_tiny_q4g64-bf16_p16-g3_streams-1-2_layers1-of-2_concurrency.json")
    for row in results_file.concurrency_table([report]).splitlines()[2:]:
        assert "| CPU (AMD EPYC) | tiny (1 of 2 layers) | q4g64-bf16 |" in row
    assert concurrency_report()["options"]["layers"] is None


def test_concurrency_table_has_a_row_per_stream_count() -> None:
    report = concurrency_report()
    assert report["passed"] is True, report["problems"]
    lead = "| 2026-12-08 | `abc1234` | CPU (AMD EPYC) | tiny | q4g64-bf16 | 16 / 3 | 2 |"
    assert results_file.concurrency_table([report]).splitlines()[2:] == [
        f"{lead} 1 | 100.0 | 32.5 | **3.25x** (4.00 / 2.50) | 10.0 / 20.0 | 10.0 / 32.5 | pass |",
        f"{lead} 2 | 400.0 | 40.0 | **10.00x** (10.00 / 10.00) | 10.0 / 20.0 | 5.0 / 50.0 | pass |",
    ]


def test_agent_replay_table_has_first_median_and_last_turns_and_the_speedups() -> None:
    with_server, alone = replay_report(), replay_report(server=False)
    assert with_server["checks"]["passed"] is True, with_server["checks"]["problems"]
    lead = "| 2026-12-08 | `abc1234` | CPU (AMD EPYC) | tiny | bf16 | 3 / 34 / 2 | 4 |"
    engine = "100.0 / 200.0 / 400.0 | 100.0 / 50.0 / 40.0 | 110.0 / 60.0 / 50.0"
    assert results_file.agent_replay_table([with_server, alone]).splitlines()[2:] == [
        f"{lead} {engine} | 150.0 / 100.0 / 100.0 | **10.00x** | 8.00x | 2.50x | pass |",
        f"{lead} {engine} | - | **10.00x** | 8.00x | - | pass |",
    ]


def test_new_kinds_add_their_tables_to_the_results_only() -> None:
    published = results_file.generated(REPORTS)
    more = results_file.generated([*REPORTS, concurrency_report(), replay_report()])
    readme, results = REPO / "README.md", REPO / "docs" / "benchmarks.md"
    assert more[readme] == published[readme]
    for table in (results_file.concurrency_table([concurrency_report()]),
                  results_file.agent_replay_table([replay_report()])):
        assert table in more[results] and table not in published[results]
    # the tables of the kinds published before stay as they were
    for table in (results_file.interleaved_table(REPORTS), results_file.paired_table(REPORTS),
                  results_file.bandwidth_table(REPORTS)):
        assert table in more[results] and table in published[results]
