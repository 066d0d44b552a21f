"""`omnia-bench`: the engine against mlx-lm (and its reference kernels, and older revisions of
itself) on the same checkpoint and the same token stream. See docs/benchmarks.md.

    omnia-bench interleaved --model qwen3-4b [--quantize 4] [--reference] [--json OUT]
    omnia-bench interleaved --model qwen3-4b --explain
    omnia-bench interleaved --model qwen3-next-80b-a3b --quantize 4 --prequantize --layers 24
    omnia-bench paired --ref REV --model qwen3-4b
    omnia-bench constrained --model qwen3-4b [--generate 256] [--constraints json,regex,lark]
    omnia-bench concurrency --model qwen3-4b [--quantize 4] [--streams 1,2,4,8,16,32]
    omnia-bench agent-replay --model qwen3-4b [--turns 20] [--context 16384] [--answer 32]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import mlx.core as mx

from mlx_omnia.bench import agent_replay, bandwidth, concurrency, constrained, measure, soak
from mlx_omnia.bench.common import (
    DECODE_NOTE,
    GENERATE_NOTE,
    Out,
    add_layers_argument,
    at_load,
    checkpoint,
    environment,
    layers_json,
    model_source,
    print_bandwidth,
    print_environment,
    progress,
    prompt_text,
    quantize_json,
    quantize_text,
    sampling_of,
    token_stream,
    write_report,
    written_quantized,
)
from mlx_omnia.bench.gate import checks_against, gate_tolerance
from mlx_omnia.bench.paired import paired
from mlx_omnia.bench.shapes import DTYPES, SHAPES
from mlx_omnia.bench.table import (
    per_run_decode_ratios,
    per_run_generate_ratios,
    row_json,
    row_of,
    run_json,
    set_ratios,
    table,
)


def explain(path: Path, args: argparse.Namespace, out: Out) -> dict[str, Any]:
    """The implementation bound to each layer declaration, grouped by implementation name."""
    report: dict[str, Any] = {}
    for reference in (False, True) if args.reference else (False,):
        arm = measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=at_load(args), reference=reference
        )
        groups: dict[str, Counter[str]] = {}
        for module_path, impl in arm.bindings.items():
            pattern = re.sub(r"\.\d+(?=[./]|$)", ".*", module_path)
            groups.setdefault(impl, Counter())[pattern] += 1
        out(f"bindings ({arm.name}): {len(arm.bindings)} layer declarations")
        for impl, patterns in sorted(groups.items()):
            out(f"  {impl}: {sum(patterns.values())}")
            width = max(len(p) for p in patterns)
            for pattern, count in sorted(patterns.items()):
                out(f"    {pattern.ljust(width)}  x{count}")
        report[arm.name] = arm.bindings
    return report


def _load_arms(
    path: Path, args: argparse.Namespace, env: dict[str, Any],
    quantize: tuple[int, int] | None, notes: list[str],
) -> list[measure.Arm]:
    progress("loading omnia")
    arms = [measure.omnia_arm(str(path), dtype=args.dtype, quantize=quantize, reference=False)]
    if getattr(args, "eager", False):
        progress("loading omnia-eager (OMNIA_COMPILE=0)")
        arms.append(measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=quantize, reference=False, eager=True
        ))
    if getattr(args, "unchained", False):
        progress("loading omnia-unchained (OMNIA_CHAINED_KERNELS=0)")
        arms.append(measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=quantize, reference=False, chained=False
        ))
    for bits in getattr(args, "kv_bits", None) or ():
        progress(f"loading omnia-kv{bits} (a {bits}-bit KV cache)")
        arms.append(measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=quantize, reference=False, kv_bits=bits
        ))
    if args.reference:
        progress("loading omnia-reference (OMNIA_REFERENCE_KERNELS=1)")
        arms.append(
            measure.omnia_arm(str(path), dtype=args.dtype, quantize=quantize, reference=True)
        )
    if args.against == "mlx-lm":
        if env["mlx_lm"] is None:
            notes.append("mlx-lm arm skipped: mlx_lm is not importable (pip install mlx-lm==0.32.2)")
        else:
            progress("loading mlx-lm")
            arms.append(measure.mlx_lm_arm(
                str(path), dtype=args.against_dtype or args.dtype, quantize=quantize
            ))
    return arms


def interleaved(args: argparse.Namespace, out: Out = print) -> dict[str, Any]:
    """Every arm in this process on one checkpoint and one token stream; runs rotate the order."""
    env = environment()
    quantize, on_disk = at_load(args), written_quantized(args)
    with checkpoint(
        args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk,
        layers=args.layers,
    ) as path:
        if args.explain:
            print_environment(env, out)
            bound = {"command": "explain", "environment": env, "bindings": explain(path, args, out)}
            if args.json:
                Path(args.json).write_text(json.dumps(bound, indent=2))
            return bound
        prompt, generate = token_stream(
            path, prompt=args.prompt, generate=args.generate, seed=args.seed
        )
        text = None if args.no_generation else prompt_text(path, prompt)
        sampling = sampling_of(args)
        notes: list[str] = []
        arms = _load_arms(path, args, env, quantize, notes)
        unlike = [a.name for a in arms if a.dtype and a.dtype != args.dtype]
        if unlike:
            notes.append(
                f"NOT LIKE FOR LIKE: {', '.join(unlike)} ran in {args.against_dtype}, omnia in "
                f"{args.dtype}; their ratios compare the two dtypes, not the engines, and those "
                "arms have no floor (it counts omnia's bytes)"
            )
        progress(f"memory bandwidth ({args.bandwidth_mib} MiB)")
        bw = bandwidth.measure(args.bandwidth_mib * 2**20, backend=env.get("backend"))
        for arm in arms:
            progress(f"warming up {arm.name}")
            measure.warm_up(arm, prompt, generate, text, sampling)
        results: dict[str, list[measure.RunResult]] = {a.name: [] for a in arms}
        orders: list[list[str]] = []
        for r in range(args.runs):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            orders.append([a.name for a in order])
            for arm in order:
                progress(f"run {r + 1}/{args.runs}: {arm.name}")
                results[arm.name].append(measure.run_once(arm, prompt, generate, text, sampling))

        # One checkpoint: every arm's floor divides by the bytes the engine says a step reads.
        step_bytes = next((a.step_bytes for a in arms if a.step_bytes), 0)
        rows = [
            row_of(arm.name, results[arm.name], len(prompt), arm.weight_bytes,
                 None if arm.name in unlike else (step_bytes or arm.weight_bytes), bw)
            for arm in arms
        ]
        baseline = "mlx-lm" if "mlx-lm" in results else arms[0].name
        set_ratios(rows, baseline)
        tolerance = gate_tolerance(args.dtype, quantized=quantize is not None or on_disk is not None,
                                   backend=env.get("backend"))
        checks = checks_against(arms[0].name, results, tolerance)
        quantized_kv = [name for name in checks if "-kv" in name]
        if quantized_kv:  # rounding the cache moves the logits by design: no kernel gate
            checks = {name: c for name, c in checks.items() if name not in quantized_kv}
            notes.append(f"{', '.join(quantized_kv)}: a quantized KV cache changes the logits by "
                         "design (its KL divergence: docs/kernels.md), so the gate leaves it out")

        print_environment(env, out)
        source = model_source(args.model, path, args.layers)
        q = quantize_text(quantize, on_disk)
        out(
            f"model: {source}  dtype {args.dtype}"
            + (f" (mlx-lm: {args.against_dtype})" if unlike else "")
            + f"  quantize {q}  prompt {len(prompt)}  "
            f"generate {len(generate)}  runs {args.runs}"
        )
        print_bandwidth(bw, rows[0].step_bytes, out)
        for name, check in checks.items():
            _print_check(name, arms[0].name, check, out)
        for note in notes:
            out(note)
        out(DECODE_NOTE)
        if text is not None:
            out(GENERATE_NOTE.format(**sampling.to_json(), n=len(generate)))
        out("")
        out(table(rows, baseline))
        spread = per_run_decode_ratios(results, baseline)
        gen_spread = per_run_generate_ratios(results, baseline)
        if args.runs > 1 and spread:
            out(f"decode vs {baseline}, run by run: " + _spread_line(spread))
        if args.runs > 1 and gen_spread:
            out(f"generate vs {baseline}, run by run: " + _spread_line(gen_spread))

        report: dict[str, Any] = {
            "command": "interleaved",
            "environment": env,
            "model": {"source": source, "shape": None if Path(args.model).is_dir() else args.model,
                      "config": json.loads((path / "config.json").read_text())},
            "options": {
                "dtype": args.dtype,
                "against_dtype": args.against_dtype,
                "like_for_like": not unlike,
                "quantize": quantize_json(quantize, on_disk),
                "layers": layers_json(args.model, args.layers),
                "prompt": len(prompt),
                "generate": len(generate),
                "runs": args.runs,
                "seed": args.seed,
                "sampling": None if text is None else sampling.to_json(),
            },
            "notes": notes,
            "bandwidth": bw.to_json(),
            "copy_bandwidth_bytes_per_s": bw.best,
            "run_orders": orders,
            "baseline": baseline,
            "decode_ratio_per_run": spread,
            "generate_ratio_per_run": gen_spread,
            "checks": checks,
            "gate_passed": all(c["passed"] for c in checks.values()),
            "arms": {
                arm.name: {
                    "dtype": arm.dtype,
                    "weight_bytes": arm.weight_bytes,
                    "step_bytes": arm.step_bytes,
                    "runs": [run_json(x) for x in results[arm.name]],
                }
                for arm in arms
            },
            "table": [row_json(r) for r in rows],
        }
    write_report(report, args)
    return report


def _spread_line(spread: dict[str, list[float]]) -> str:
    return "; ".join(
        f"{name} " + " ".join(f"{v:.2f}x" for v in values) for name, values in spread.items()
    )


def _print_check(name: str, first: str, check: dict[str, Any], out: Out) -> None:
    flips = check["argmax_flips"]
    out(
        f"gate {name} vs {first}: {'PASS' if check['passed'] else 'FAIL'} at tolerance "
        f"{check['tolerance']:.3g} of the largest |logit|: prompt last row "
        f"{check['prefill_max_rel_diff']:.3g}, decode steps max {check['decode_max_rel_diff']:.3g}; "
        f"argmax agree {check['argmax_agree']}/{check['steps']}"
        + (f", {sum(not f['near_tie'] for f in flips)} of {len(flips)} flips not near-ties"
           if flips else "")
    )


def _generation_args(p: argparse.ArgumentParser, *, generate_help: str) -> None:
    """What every command measuring one checkpoint takes: the model, its format, the token
    stream's lengths, the runs, the sampling of free generations and where the report goes."""
    p.add_argument("--model", required=True,
                   help=f"a checkpoint directory, or a shape to build with random weights: {', '.join(SHAPES)}")
    add_layers_argument(p)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                   help="affine-quantize at load, both arms the same way (bits)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--prequantize", action="store_true",
                   help="with --quantize and a named shape: write the random checkpoint already "
                        "quantized (MLX layout), which the arms load as is; a 30B MoE then fits "
                        "a 64 GB disk (~17 GB at 4 bits, ~61 GB at bfloat16)")
    p.add_argument("--prompt", type=int, default=512, help="prompt length in tokens")
    p.add_argument("--generate", type=int, default=128, help=generate_help)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="for the random weights and token ids")
    p.add_argument("--json", default=None, metavar="OUT", help="write the details here")
    p.add_argument("--workdir", default=None, help="where random checkpoints are built (a temp dir)")
    p.add_argument("--temperature", type=float, default=measure.Sampling.temperature,
                   help="the free generation's sampling (every arm the same)")
    p.add_argument("--top-p", type=float, default=measure.Sampling.top_p)
    p.add_argument("--top-k", type=int, default=measure.Sampling.top_k)
    p.add_argument("--results", default=None, metavar="DIR",
                   help="also write the JSON under DIR with a name from its date, revision, "
                        "device and model (docs/bench-results/ holds the published ones)")


def _common(p: argparse.ArgumentParser, *, default_mib: int) -> None:
    _generation_args(p, generate_help="teacher-forced decode steps")
    p.add_argument("--bandwidth-mib", type=int, default=default_mib,
                   help="size of the array copied to measure bandwidth")
    p.add_argument("--no-generation", action="store_true",
                   help="leave out the free generation (stream API) of each run")


def parser() -> argparse.ArgumentParser:
    default_mib = 256 if mx.default_device() == mx.cpu else 2048
    top = argparse.ArgumentParser(prog="omnia-bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    inter = sub.add_parser("interleaved", help="all arms in this process, interleaved")
    _common(inter, default_mib=default_mib)
    inter.add_argument("--against", choices=["mlx-lm", "none"], default="mlx-lm",
                       help="the baseline arm (skipped, with a note, when mlx_lm is not importable)")
    inter.add_argument("--against-dtype", default=None, choices=list(DTYPES),
                       help="load the mlx-lm arm in this dtype instead of --dtype: NOT like "
                            "for like (the output and the JSON say so, and that arm has no floor)")
    inter.add_argument("--kv-bits", type=int, choices=[4, 8], action="append", default=None,
                       help="add an omnia arm caching keys and values at these bits (repeatable)")
    inter.add_argument("--reference", action="store_true",
                       help="add the omnia-reference arm (OMNIA_REFERENCE_KERNELS=1)")
    inter.add_argument("--unchained", action="store_true",
                       help="add the omnia-unchained arm (OMNIA_CHAINED_KERNELS=0: no two "
                            "declarations share a launch)")
    inter.add_argument("--eager", action="store_true",
                       help="add the omnia-eager arm (decode without the compiled step)")
    inter.add_argument("--explain", action="store_true",
                       help="print the implementation bound to each layer declaration and exit")
    pair = sub.add_parser("paired", help="this tree against another revision, one process per arm")
    _common(pair, default_mib=default_mib)
    pair.add_argument("--ref", required=True,
                      help="a git revision of this checkout, or a directory holding src/mlx_omnia")
    soak_p = sub.add_parser("soak", help="many streaming clients against a live omnia-server, "
                                         "some hanging up; errors, mixed-up answers, RSS, /metrics")
    soak.add_arguments(soak_p)
    cons = sub.add_parser("constrained", help="free generations against generations under a "
                                              "JSON schema, a regex and a Lark grammar")
    _generation_args(cons, generate_help="tokens each generation is timed over")
    constrained.add_arguments(cons)
    conc = sub.add_parser("concurrency", help="many streams decoded together: the engine's Batch "
                                              "against mlx-lm's BatchGenerator")
    _generation_args(conc, generate_help="tokens each stream generates")
    concurrency.add_arguments(conc)
    replay = sub.add_parser("agent-replay", help="a long chat resent turn by turn: time to first "
                                                 "token uncached, from the prefix cache's memory "
                                                 "and disk, and mlx_lm.server's")
    agent_replay.add_arguments(replay)
    return top


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    stream = out or sys.stdout

    def write(line: str) -> None:
        print(line, file=stream, flush=True)

    if args.command == "soak":
        return soak.run(args, write)
    if args.command == "agent-replay":
        agent_replay.agent_replay(args, write)
        return 0
    if args.prompt < 1 or args.generate < 1 or args.runs < 1:
        raise SystemExit("--prompt, --generate and --runs must be at least 1")

    if args.command == "paired":
        paired(args, write)
    elif args.command == "constrained":
        constrained.constrained(args, write)
    elif args.command == "concurrency":
        concurrency.concurrency(args, write)
    else:
        interleaved(args, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
