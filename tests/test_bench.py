"""omnia-bench on the tiny shape: the output has its fields, and every arm computed the same thing.

No speed is asserted here (PERF.md: performance claims live in the bench output, not in tests)."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_omnia.bench import gate, measure, results_file, table
from mlx_omnia.bench import main as bench
from mlx_omnia.bench.shapes import SHAPES, build_checkpoint, checkpoint_bytes, tensor_shapes

HAS_MLX_LM = measure.mlx_lm_importable() is not None
SMALL = ["--model", "tiny", "--prompt", "16", "--generate", "8", "--runs", "1",
         "--bandwidth-mib", "8"]


def run_bench(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    out = io.StringIO()
    report_file = tmp_path / "bench.json"
    assert bench.main([*args, "--json", str(report_file)], out=out) == 0
    return out.getvalue(), json.loads(report_file.read_text())


def table_rows(text: str) -> dict[str, list[str]]:
    """The table printed last: {arm: cells}."""
    lines = text.rstrip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    return {line.split()[0]: line.split() for line in lines[start + 2:]}


def assert_positive_row(row: dict[str, Any]) -> None:
    for key in ("prefill_tok_s", "decode_tok_s", "weight_bytes", "floor_tok_s", "floor_share"):
        assert row[key] > 0 and math.isfinite(row[key]), (key, row)


def test_named_shapes_have_the_published_parameter_counts() -> None:
    counts = {name: sum(math.prod(s) for s in tensor_shapes(c).values()) for name, c in SHAPES.items()}
    assert counts["qwen3-4b"] == 4_022_468_096
    assert counts["qwen3-0.6b"] == 596_049_920
    assert counts["llama3.2-1b"] == 1_235_814_400
    assert counts["smollm2-135m"] == 134_515_008
    assert counts["qwen3-30b-a3b"] == 30_532_122_624
    assert counts["olmoe-1b-7b"] == 6_919_161_856


def test_interleaved_float32_arms_compute_the_same_logits(tmp_path: Path) -> None:
    text, report = run_bench(tmp_path, "interleaved", *SMALL, "--dtype", "float32", "--reference",
                             "--unchained")
    arms = ["omnia", "omnia-unchained", "omnia-reference", *(["mlx-lm"] if HAS_MLX_LM else [])]
    assert list(table_rows(text)) == arms
    assert "device: Device(" in text and "mlx 0." in text
    assert [r["arm"] for r in report["table"]] == arms
    for row in report["table"]:
        assert_positive_row(row)
    assert report["copy_bandwidth_bytes_per_s"] == report["bandwidth"]["best"] > 0
    assert report["bandwidth"]["methods"].keys() == {"mlx_add", "mlx_sum", "host_memcpy", "host_sum"}
    assert report["options"] | {"seed": 0} == {
        "dtype": "float32", "against_dtype": None, "like_for_like": True, "quantize": None,
        "layers": None, "prompt": 16, "generate": 8, "runs": 1, "seed": 0,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 0,
                     "stop": "\n\nUser:"},
    }
    # Every arm holds the same weights and fed the same ids, so the logits agree: this checks
    # that the comparison compares like with like.
    assert len({report["arms"][a]["weight_bytes"] for a in arms}) == 1
    for arm in arms[1:]:
        check = report["checks"][arm]
        assert check["argmax_agree"] == check["steps"] == 8 and check["argmax_flips"] == []
        assert check["passed"] and check["tolerance"] == gate.gate_tolerance(
            "float32", quantized=False, backend="cpu"
        )
        assert check["prefill_last_argmax"][0] == check["prefill_last_argmax"][1]
        assert check["prefill_max_rel_diff"] <= check["tolerance"]
    assert report["gate_passed"] is True
    for arm in arms:
        (run,) = report["arms"][arm]["runs"]
        assert len(run["decode_step_s"]) == 8 and run["prefill_s"] > 0
        # The free generation: 8 sampled tokens through the arm's own API, timed after the first.
        gen = run["generation"]
        assert gen["tokens"] == 8 and gen["finish"] == "length" and gen["prompt_tokens"] > 0
        assert gen["first_s"] > 0 and gen["decode_s"] > 0 and gen["chars"] > 0
    if HAS_MLX_LM:
        assert report["baseline"] == "mlx-lm"
        # decode, generate and prefill ratios of the baseline to itself
        assert table_rows(text)["mlx-lm"][5:8] == ["1.000x", "1.000x", "1.000x"]


def test_interleaved_quantized_both_sides_the_same_way(tmp_path: Path) -> None:
    text, report = run_bench(tmp_path, "interleaved", *SMALL, "--quantize", "4")
    assert report["options"]["quantize"] == {"bits": 4, "group_size": 64}
    assert "quantize affine 4-bit g64" in text
    # 4-bit g64: 0.5 byte per weight plus a bf16 scale and bias per 64 weights.
    matrices = sum(math.prod(s) for s in tensor_shapes(SHAPES["tiny"]).values() if len(s) == 2)
    for row in report["table"]:
        assert_positive_row(row)
        assert row["weight_bytes"] < matrices * 0.6
    if HAS_MLX_LM:
        assert report["arms"]["omnia"]["weight_bytes"] == report["arms"]["mlx-lm"]["weight_bytes"]
        check = report["checks"]["mlx-lm"]
        assert check["prefill_last_argmax"][0] == check["prefill_last_argmax"][1]
        assert check["passed"], check


def test_mlx_lm_arm_is_skipped_with_a_note_when_not_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(measure, "mlx_lm_importable", lambda: None)
    text, report = run_bench(tmp_path, "interleaved", *SMALL)
    assert "mlx-lm arm skipped: mlx_lm is not importable" in text
    assert list(table_rows(text)) == ["omnia"]
    assert report["baseline"] == "omnia"


def test_explain_counts_bindings_by_implementation(tmp_path: Path) -> None:
    text, report = run_bench(tmp_path, "interleaved", "--model", "tiny", "--explain")
    bindings = report["bindings"]["omnia"]
    assert "self_attn.q_proj" in " ".join(bindings)
    for impl in set(bindings.values()):
        count = sum(v == impl for v in bindings.values())
        assert f"  {impl}: {count}" in text
    assert re.search(r"model\.layers\.\*\.self_attn\.q_proj +x2\n", text)
    assert re.search(r"model\.layers\.\*/ProjectAttend\(self_attn\.q_proj, .*\) +x2\n", text)


def test_paired_runs_each_tree_in_its_own_process(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    text, report = run_bench(tmp_path, "paired", *SMALL, "--ref", str(root),
                             "--results", str(tmp_path / "results"))
    assert list(table_rows(text)) == ["working", "ref"]
    assert report["argmax_identical"] is True
    for row in report["table"]:
        assert_positive_row(row)
    # the published form: a file named by results_file, a row of the paired table
    (saved,) = (tmp_path / "results").glob("*.json")
    assert saved.name == results_file.file_name(report) and saved.name.endswith("_paired.json")
    (row,) = results_file.paired_table([report]).splitlines()[2:]
    assert f"| `{root}` | " in row and "| tiny | bf16 |" in row and row.endswith("| identical |")


def test_moe_checkpoint_is_sharded_with_per_expert_tensors(tmp_path: Path) -> None:
    import mlx.core as mx

    import mlx_omnia

    path = build_checkpoint("tiny-moe", tmp_path / "ckpt", dtype="float32", shard_bytes=100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(tensor_shapes(SHAPES["tiny-moe"]))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
    on_disk = sum((path / f).stat().st_size for f in shards)
    assert 0 <= on_disk - checkpoint_bytes("tiny-moe", dtype="float32") < 4096 * len(shards)
    logits = mlx_omnia.load(str(path), dtype="float32").logits([1, 2, 3])
    assert logits.shape == (3, 512) and bool(mx.all(mx.isfinite(logits)))


def test_interleaved_moe_arms_load_the_same_checkpoint(tmp_path: Path) -> None:
    # float32: MLX's CPU gather_mm (the experts' matmul) takes float32 only.
    small = ["--model", "tiny-moe", *SMALL[2:]]
    text, report = run_bench(tmp_path, "interleaved", *small, "--dtype", "float32")
    assert report["model"]["config"]["model_type"] == "qwen3_moe"
    if HAS_MLX_LM:
        assert list(table_rows(text)) == ["omnia", "mlx-lm"]
        assert report["arms"]["omnia"]["weight_bytes"] == report["arms"]["mlx-lm"]["weight_bytes"]
        check = report["checks"]["mlx-lm"]
        assert check["argmax_agree"] == check["steps"] == 8
        assert check["passed"], check


def test_interleaved_prequantized_moe_checkpoint(tmp_path: Path) -> None:
    small = ["--model", "tiny-moe", *SMALL[2:]]
    # bfloat16 as for the 30B shape (quantized experts run gather_qmm, which the CPU has).
    text, report = run_bench(tmp_path, "interleaved", *small, "--quantize", "4", "--prequantize")
    assert report["options"]["quantize"] == {"bits": 4, "group_size": 64, "on_disk": True}
    assert report["model"]["config"]["quantization"] == {"group_size": 64, "bits": 4}
    assert "quantize affine 4-bit g64 (written quantized)" in text
    matrices = sum(math.prod(s) for s in tensor_shapes(SHAPES["tiny-moe"]).values() if len(s) == 2)
    for row in report["table"]:
        assert_positive_row(row)
        assert row["weight_bytes"] < matrices * 0.6
    if HAS_MLX_LM:
        # Both arms load the same quantized tensors: the same arithmetic, up to bf16 rounding.
        assert report["arms"]["omnia"]["weight_bytes"] == report["arms"]["mlx-lm"]["weight_bytes"]
        check = report["checks"]["mlx-lm"]
        assert check["prefill_last_argmax"][0] == check["prefill_last_argmax"][1]
        assert check["passed"], check


def test_prequantize_needs_quantize_and_a_named_shape(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--prequantize needs --quantize"):
        bench.main(["interleaved", *SMALL, "--prequantize"], out=io.StringIO())


@pytest.mark.skipif(not HAS_MLX_LM, reason="mlx-lm is part of the dev extra")
def test_against_dtype_loads_the_mlx_lm_arm_in_its_own_dtype(tmp_path: Path) -> None:
    text, report = run_bench(
        tmp_path, "interleaved", *SMALL, "--dtype", "float32", "--against-dtype", "bfloat16"
    )
    assert "dtype float32 (mlx-lm: bfloat16)" in text
    assert "NOT LIKE FOR LIKE: mlx-lm ran in bfloat16, omnia in float32" in text
    assert report["options"]["against_dtype"] == "bfloat16"
    assert report["options"]["like_for_like"] is False
    ours, theirs = report["arms"]["omnia"]["weight_bytes"], report["arms"]["mlx-lm"]["weight_bytes"]
    assert ours == 2 * theirs
    # No floor for the arm in another dtype: the floor counts the engine's bytes.
    rows = {r["arm"]: r for r in report["table"]}
    assert rows["mlx-lm"]["floor_tok_s"] is None and rows["omnia"]["floor_tok_s"] > 0


def test_gate_tolerance_is_fixed_per_dtype_and_format() -> None:
    """2^(slack - p) of the largest |logit| for p significand bits (slack 4 for 16-bit formats,
    10 for float32's long reductions), twice that quantized; float32 on CUDA counts as TF32.
    Never derived from the arms under test."""
    assert gate.gate_tolerance("bfloat16", quantized=False, backend="cuda") == 2.0**-4
    assert gate.gate_tolerance("bfloat16", quantized=True, backend="cuda") == 2.0**-3
    assert gate.gate_tolerance("float16", quantized=False, backend="cuda") == 2.0**-7
    assert gate.gate_tolerance("float32", quantized=False, backend="cuda") == 2.0**-7
    assert gate.gate_tolerance("float32", quantized=False, backend="cpu") == 2.0**-14


def _result(prefill: list[float], tops: list[dict[int, float]]) -> measure.RunResult:
    argmax = [max(t, key=t.__getitem__) for t in tops]
    return measure.RunResult(prefill_s=1.0, decode_step_s=[0.1] * len(tops),
                             prefill_last_logits=np.array(prefill, np.float32),
                             decode_argmax=argmax, decode_top=tops)


def test_gate_passes_rounding_and_near_ties_and_fails_anything_else() -> None:
    tol = 0.01
    ref = _result([4.0, 1.0], [{1: 10.0, 2: 5.0}, {3: 10.0, 4: 9.95}])
    # rounding within the tolerance, and a flip where the reference's margin is 0.5 %
    ok = _result([4.02, 1.0], [{1: 10.05, 2: 5.0}, {3: 9.96, 4: 9.99}])
    check = gate.gate(ref, ok, tol)
    assert check["passed"] and check["argmax_agree"] == 1
    assert check["argmax_flips"] == [{"step": 1, "margin": pytest.approx(0.005), "near_tie": True}]
    assert check["decode_rel_diff"] == pytest.approx([0.005, 0.004])
    # a clear winner flipped (margin 50 %): fails, though every logit is within the tolerance
    # of its step apart from that one
    flipped = _result([4.0, 1.0], [{1: 5.0, 2: 10.0}, {3: 10.0, 4: 9.95}])
    assert not gate.gate(ref, flipped, tol)["passed"]
    # the prompt's logits off by 2 %
    assert not gate.gate(ref, _result([4.08, 1.0], ref.decode_top), tol)["passed"]
    # one decode step's logits off by 2 % without changing its argmax
    drift = _result([4.0, 1.0], [{1: 10.2, 2: 5.0}, {3: 10.0, 4: 9.95}])
    assert not gate.gate(ref, drift, tol)["passed"]


def test_per_run_ratios_pair_each_run_with_the_baselines_same_run() -> None:
    """The spread line: arm / baseline decode rate within each run (not medians over runs)."""

    def run(pipelined_s: float) -> measure.RunResult:
        return measure.RunResult(prefill_s=1.0, decode_step_s=[pipelined_s],
                                 prefill_last_logits=np.zeros(2, np.float32), decode_argmax=[0],
                                 decode_pipelined_s=pipelined_s)

    results = {"omnia": [run(0.002), run(0.004)], "mlx-lm": [run(0.006), run(0.006)]}
    ratios = table.per_run_decode_ratios(results, "mlx-lm")
    assert ratios.keys() == {"omnia"}
    assert ratios["omnia"] == pytest.approx([3.0, 1.5])
    assert table.per_run_decode_ratios(results, "absent") == {}


def test_soak_drives_a_live_server_and_checks_what_it_saw(tmp_path: Path) -> None:
    """omnia-bench soak against omnia-server (a tiny llama) for a few seconds: clients of the three
    dialects, some hanging up, every complete answer equal to the same request answered alone,
    /metrics agreeing (the published soak runs the embedded model: docs/benchmarks.md)."""
    from mlx_omnia.bench.main import main
    from tests.fixtures.tiny import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "tiny", max_position_embeddings=64)
    out = io.StringIO()
    report = tmp_path / "soak.json"
    rc = main(["soak", "--serve", str(tiny), "--streams", "6", "--seconds", "4", "--sample", "1",
               "--disconnect", "0.5", "--json", str(report)], out=out)
    text = out.getvalue()
    assert rc == 0, text
    data = json.loads(report.read_text())
    assert data["ok"] and data["errors"] == 0 and data["mixed"] == 0, text
    assert data["complete"] > 0 and data["requests"] > data["complete"], text  # some hung up
    assert data["rss"] and "server RSS" in text


def test_constrained_answers_follow_their_grammars_for_every_timed_token(tmp_path: Path) -> None:
    into = tmp_path / "results"
    text, report = run_bench(tmp_path, "constrained", "--model", "tiny", "--prompt", "16",
                             "--generate", "4", "--runs", "2", "--results", str(into))
    arms = ["free", "json", "regex", "lark"]
    assert [r["arm"] for r in report["table"]] == arms
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")][1:] == [
        f"| {a}" for a in arms
    ]
    assert report["passed"] is True, [r["problems"] for r in report["table"]]
    assert report["options"]["sampling"]["temperature"] == 0.8
    assert [sorted(order) for order in report["run_orders"]] == [sorted(arms)] * 2
    for arm in arms:
        ratios = report["ratio_per_run"][arm]
        assert len(ratios) == 2 and all(r > 0 and math.isfinite(r) for r in ratios)
        for run in report["arms"][arm]["runs"]:
            # Every arm is timed over the same 4 tokens: no answer ended before them.
            assert run["generation"]["tokens"] >= 4 and run["problem"] is None
            assert (run["mask"] is None) == (arm == "free")
            if run["mask"] is not None:
                assert run["mask"]["refused"] is None and run["mask"]["tokens"] >= 3
                assert 0 < run["mask"]["median_s"] <= run["mask"]["max_s"]
    # The JSON answer ran on to its end (one string of 1 to 8 characters) and parses.
    json_run = report["arms"]["json"]["runs"][0]
    assert json_run["finish"] == "stop" and json_run["mask"]["accepting"] is True
    (item,) = json.loads(json_run["text_head"])
    assert 1 <= len(item) <= 8
    # The regex and lark answers are cut at 4 tokens: words of a-z, still unfinished.
    for arm in ("regex", "lark"):
        run = report["arms"][arm]["runs"][0]
        assert run["finish"] == "length" and run["tokens_written"] == 4
        assert re.fullmatch(r"(?: [a-z]+)* ?", run["text_head"])
    # Its results file is named as the others, and the generated tables pass over it.
    (saved,) = into.glob("*.json")
    assert saved.name.endswith("_tiny_bf16_p16-g4_constrained.json")
    published = results_file.load_all()
    saved_report = json.loads(saved.read_text())
    assert results_file.generated([*published, saved_report]) == results_file.generated(published)


def assert_positive(value: float, what: object) -> None:
    assert value > 0 and math.isfinite(value), what


def test_concurrency_runs_every_stream_its_whole_length(tmp_path: Path) -> None:
    into = tmp_path / "results"
    text, report = run_bench(tmp_path, "concurrency", "--model", "tiny", "--streams", "1,3",
                             "--prompt", "16", "--generate", "6", "--runs", "2",
                             "--results", str(into))
    arms = ["omnia", *(["mlx-lm"] if HAS_MLX_LM else [])]
    assert report["passed"] is True, report["problems"]
    assert [(r["streams"], r["arm"]) for r in report["table"]] == [
        (n, a) for n in (1, 3) for a in arms
    ]
    printed = [line.split()[:2] for line in text.splitlines() if re.match(r" +[13] +\S", line)]
    assert printed == [[str(n), a] for n in (1, 3) for a in arms]
    for row in report["table"]:
        # every stream generated its 6 tokens from its own 16-word (16-token) prompt
        assert row["tokens"] == 6 * row["streams"] and row["finish"] == ["length"]
        assert row["prompt_tokens"] == 16 * row["streams"]
        for key in ("decode_tok_s", "steady_tok_s", "prefill_s", "first_token_median_s",
                    "inter_token_median_s"):
            assert_positive(row[key], (key, row))
        assert row["first_token_median_s"] <= row["first_token_max_s"]
    for arm in arms:
        for n in (1, 3):
            runs = report["arms"][arm][str(n)]
            assert len(runs) == 2
            for run in runs:
                assert len(run["streams"]) == n and run["total_tokens"] == 6 * n
                assert 0 < run["first_s"] <= run["prefill_s"] <= run["last_s"]
                for stream in run["streams"]:
                    assert stream["tokens"] == 6 and stream["finish"] == "length"
                    assert run["first_s"] <= stream["first_s"] <= run["prefill_s"]
                    assert_positive(stream["inter_token_s"], stream)
    if HAS_MLX_LM:
        assert report["baseline"] == "mlx-lm"
        assert report["run_orders"] == [["omnia", "mlx-lm"], ["mlx-lm", "omnia"]]
        assert report["ratio_per_run"].keys() == {"1", "3"}
        for ratios in report["ratio_per_run"].values():
            assert len(ratios) == 2 and all(r > 0 and math.isfinite(r) for r in ratios)
        assert {r["ratio"] for r in report["table"] if r["arm"] == "mlx-lm"} == {1.0}
    (saved,) = into.glob("*.json")
    assert saved.name.endswith("_tiny_bf16_p16-g6_streams-1-3_concurrency.json")
    published = results_file.concurrency_table([json.loads(saved.read_text())]).splitlines()[2:]
    ours = {r["streams"]: r for r in report["table"] if r["arm"] == "omnia"}
    assert [row.split(" | ")[7:9] for row in published] == [
        [str(n), f"{ours[n]['decode_tok_s']:,.1f}"] for n in (1, 3)
    ]


def test_agent_replay_serves_later_turns_from_the_prefix_cache(tmp_path: Path) -> None:
    """Three turns of a ~600-token chat in blocks of 64: from turn 2 on, the cached arms are
    served the earlier turns' whole blocks, from memory and, after a restart, from disk; the
    mlx_lm.server arm runs when it starts (else the report says why)."""
    into = tmp_path / "results"
    text, report = run_bench(tmp_path, "agent-replay", "--model", "tiny", "--turns", "3",
                             "--context", "600", "--answer", "4", "--block-tokens", "64",
                             "--server-timeout", "60", "--results", str(into))
    checks = report["checks"]
    assert checks["passed"] is True, checks["problems"]
    prompts = [row["prompt_tokens"] for row in report["table"]]
    assert prompts == sorted(set(prompts)) and 540 <= prompts[-1] <= 600
    assert report["last_turn"]["prompt_tokens"] == prompts[-1]
    for name in ("uncached", "cached-memory", "cached-disk"):
        turns = report["arms"][name]["turns"]
        assert [t["prompt_tokens"] for t in turns] == prompts
        for i, turn in enumerate(turns):
            assert 0 < turn["first_s"] <= turn["total_s"] and math.isfinite(turn["total_s"])
            assert turn["tokens"] == 4 and turn["finish"] == "length"
            assert turn["new_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
            if name == "uncached" or i == 0:
                assert turn["cached_tokens"] == 0
            else:  # whole blocks of the earlier turns, the last prompt token left to prefill
                assert turn["cached_tokens"] >= prompts[i - 1] // 64 * 64 > 0
                assert turn["cached_tokens"] % 64 == 0 and turn["new_tokens"] >= 1
    # the disk arm restarted before every turn: nothing in memory, its hits read from disk
    for i, turn in enumerate(report["arms"]["cached-disk"]["turns"]):
        assert turn["cache"]["memory_blocks"] == 0
        assert turn["cache"]["hits"] * 64 == turn["cached_tokens"]
        assert (turn["cache"]["disk_blocks"] > 0) == (i > 0)
    for ratio in report["last_turn"]["ratios"].values():
        assert_positive(ratio, report["last_turn"])
    if not HAS_MLX_LM or "mlx-lm-server" in report["skipped"]:
        why = report["skipped"]["mlx-lm-server"]
        assert why and f"mlx-lm-server arm skipped: {why}" in text
    else:
        server = report["arms"]["mlx-lm-server"]["turns"]
        assert [t["prompt_tokens"] for t in server] == prompts  # the same template, same tokens
        assert checks["server_prompt_tokens_equal"] == 3
        for turn in server:
            assert 0 < turn["first_s"] <= turn["total_s"] and turn["tokens"] >= 1
        assert server[-1]["cached_tokens"] > 0
    rows = [line.split() for line in text.splitlines() if re.match(r" +[123] +\d+ +\d+ ", line)]
    assert [r[:3] for r in rows] == [[str(i + 1), str(p), str(p - ([0, *prompts][i]))]
                                     for i, p in enumerate(prompts)]
    (saved,) = into.glob("*.json")
    assert saved.name.endswith("_tiny_bf16_context600-turns3-answer4-block64_agent-replay.json")
    (published,) = results_file.agent_replay_table([json.loads(saved.read_text())]).splitlines()[2:]
    speedup = report["last_turn"]["ratios"]["uncached/cached-memory"]
    assert f"| 3 / {prompts[-1]} / 4 | 64 |" in published and f"**{speedup:.2f}x**" in published
