"""Published benchmark results (docs/bench-results/): each names a commit of this repository
whose src/mlx_omnia it ran, byte for byte, and the tables in docs/benchmarks.md and README.md
are exactly what `python -m mlx_omnia.bench.results_file` generates from them."""

from __future__ import annotations

import io
import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mlx_omnia.bench import main as bench
from mlx_omnia.bench import results_file

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
