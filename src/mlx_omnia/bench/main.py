"""`omnia-bench`: the engine against mlx-lm (and its reference kernels, and older revisions of
itself) on the same checkpoint and the same token stream. See docs/benchmarks.md.

    omnia-bench interleaved --model qwen3-4b [--quantize 4] [--reference] [--json OUT]
    omnia-bench interleaved --model qwen3-4b --explain
    omnia-bench paired --ref REV --model qwen3-4b
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO, cast

import mlx.core as mx
import numpy as np

import mlx_omnia
from mlx_omnia.bench import bandwidth, measure, results_file
from mlx_omnia.bench.shapes import DTYPES, SHAPES, build_checkpoint

Out = Callable[[str], None]


# -- what every command shares --------------------------------------------------------------
def _progress(message: str) -> None:
    print(f"[omnia-bench] {message}", file=sys.stderr, flush=True)


def _git_revision(tree: Path) -> str | None:
    """`git describe` of the tree; OMNIA_BENCH_REVISION overrides it (a copied tree whose git
    metadata is stale, as on a lent machine)."""
    if os.environ.get("OMNIA_BENCH_REVISION"):
        return os.environ["OMNIA_BENCH_REVISION"]
    try:
        rev = subprocess.run(
            ["git", "-C", str(tree), "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev or None


def _source_root() -> Path:
    """The tree this mlx_omnia was imported from (…/src/mlx_omnia/__init__.py -> …)."""
    return Path(mlx_omnia.__file__).resolve().parents[2]


def environment() -> dict[str, Any]:
    """Device and versions, as printed and as written to the JSON."""
    info: dict[str, Any] = dict(mlx_omnia.runtime_info())
    info["device"] = str(mx.default_device())
    info["mlx"] = str(getattr(mx, "__version__", "?"))
    info["mlx_lm"] = measure.mlx_lm_importable()
    info["mlx_omnia_revision"] = _git_revision(_source_root())
    info["source_sha256"] = results_file.source_digest(
        results_file.tree_files(Path(mlx_omnia.__file__).resolve().parent)
    )
    info["python"] = platform.python_version()
    info["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    info["device_info"] = bandwidth.device_info()
    info["device_name"] = info["device_info"].get("device_name")
    return info


def _print_environment(env: dict[str, Any], out: Out) -> None:
    out(
        f"device: {env['device']} ({env.get('backend')})  mlx {env['mlx']}  "
        f"mlx-lm {env['mlx_lm'] or 'not importable'}  "
        f"mlx-omnia {env.get('mlx_omnia_revision') or env.get('mlx_omnia') or '?'}  "
        f"python {env['python']}  blas {env.get('blas') or 'MLX default'}"
    )


@contextmanager
def checkpoint(
    model: str, *, dtype: str, seed: int, workdir: str | None,
    quantize: tuple[int, int] | None = None,
) -> Generator[Path, None, None]:
    """A checkpoint directory: `model` itself when it is one, else a random-weight checkpoint
    of the named shape, built for this run and removed after it (written already quantized
    when `quantize` is given)."""
    given = Path(model)
    if given.is_dir():
        yield given
        return
    if model not in SHAPES:
        raise SystemExit(
            f"--model {model!r} is neither a checkpoint directory nor a known shape "
            f"({', '.join(SHAPES)})"
        )
    with tempfile.TemporaryDirectory(prefix="omnia-bench-", dir=workdir) as tmp:
        q = "" if quantize is None else f", written {quantize[0]}-bit g{quantize[1]}"
        _progress(f"building a random-weight {model} checkpoint ({dtype}{q}) in {tmp}")
        yield build_checkpoint(model, Path(tmp) / model, dtype=dtype, seed=seed, quantize=quantize)


def token_stream(path: Path, *, prompt: int, generate: int, seed: int) -> tuple[list[int], list[int]]:
    """Fixed random ids below the model's vocab_size: the prompt, then the teacher-forced ids."""
    config = cast(dict[str, Any], json.loads((path / "config.json").read_text()))
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, vocab, size=prompt + generate)]
    return ids[:prompt], ids[prompt:]


def _quantize(args: argparse.Namespace) -> tuple[int, int] | None:
    return None if args.quantize is None else (int(args.quantize), int(args.group_size))


def _on_disk(args: argparse.Namespace) -> tuple[int, int] | None:
    """--prequantize: the quantization build_checkpoint writes (the arms then load it as is)."""
    if not getattr(args, "prequantize", False):
        return None
    if args.quantize is None or Path(args.model).is_dir():
        raise SystemExit("--prequantize needs --quantize BITS and a named shape as --model")
    return _quantize(args)


def _at_load(args: argparse.Namespace) -> tuple[int, int] | None:
    """The quantization the arms apply at load: none when the checkpoint was written quantized."""
    return None if _on_disk(args) else _quantize(args)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


DECODE_NOTE = ("decode = steps queued one ahead, as a generation loop runs them (the rate a "
               "generation sustains); step = one step evaluated and waited on (its latency)")


# -- the table ------------------------------------------------------------------------------
@dataclass
class Row:
    arm: str
    prefill_tok_s: float
    decode_tok_s: float          # pipelined: steps queued one ahead, a generation loop's rate
    step_tok_s: float            # 1 / the median latency of one waited step
    weight_bytes: int
    floor_tok_s: float | None    # the step's bytes over the best copy bandwidth measured
    step_bytes: int = 0          # weights one decode step reads (the floor's numerator)
    spec_floor_tok_s: float | None = None  # the same over the card's datasheet bandwidth
    generate_tok_s: float | None = None    # free generation's decode rate (stream API)
    first_token_s: float | None = None     # free generation: the call to the first text
    prefill_ratio: float | None = None
    decode_ratio: float | None = None
    step_ratio: float | None = None
    generate_ratio: float | None = None

    @property
    def floor_share(self) -> float | None:
        return None if not self.floor_tok_s else self.decode_tok_s / self.floor_tok_s

    @property
    def spec_share(self) -> float | None:
        return None if not self.spec_floor_tok_s else self.decode_tok_s / self.spec_floor_tok_s


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".1f", " %")


def table(rows: Sequence[Row], against: str) -> str:
    head = (
        "arm", "prefill tok/s", "decode tok/s", "generate tok/s", "first token ms",
        f"prefill vs {against}", f"decode vs {against}", f"generate vs {against}",
        "step tok/s", "weights MB", "floor tok/s", "% of floor", "% of spec",
    )
    body = [
        (
            r.arm,
            _fmt(r.prefill_tok_s, ",.1f"),
            _fmt(r.decode_tok_s, ",.2f"),
            _fmt(r.generate_tok_s, ",.2f"),
            _fmt(None if r.first_token_s is None else 1e3 * r.first_token_s, ",.1f"),
            _fmt(r.prefill_ratio, ".3f", "x"),
            _fmt(r.decode_ratio, ".3f", "x"),
            _fmt(r.generate_ratio, ".3f", "x"),
            _fmt(r.step_tok_s, ",.2f"),
            _fmt(r.weight_bytes / 1e6, ",.1f"),
            _fmt(r.floor_tok_s, ",.1f"),
            _pct(r.floor_share),
            _pct(r.spec_share),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def per_run_decode_ratios(
    results: dict[str, list[measure.RunResult]], baseline: str
) -> dict[str, list[float]]:
    """Each arm's pipelined decode rate over the baseline's, run by run (the arms of one run ran
    one after another): how far the medians' ratio moves between runs."""
    base = results.get(baseline)
    if not base:
        return {}
    return {
        name: [b.decode_pipelined_s / x.decode_pipelined_s for x, b in zip(runs, base, strict=True)]
        for name, runs in results.items()
        if name != baseline
    }


def per_run_generate_ratios(
    results: dict[str, list[measure.RunResult]], baseline: str
) -> dict[str, list[float]]:
    """The same for the free generation's decode rate."""
    rates = {
        name: [x.generation.decode_tok_s for x in runs if x.generation is not None]
        for name, runs in results.items()
    }
    base = rates.get(baseline)
    if not base or len(base) != len(results[baseline]):
        return {}
    return {
        name: [x / b for x, b in zip(values, base, strict=True)]
        for name, values in rates.items()
        if name != baseline and len(values) == len(base)
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _ratios(rows: list[Row], baseline: str) -> None:
    base = next((r for r in rows if r.arm == baseline), None)
    if base is None:
        return
    for r in rows:
        r.prefill_ratio = r.prefill_tok_s / base.prefill_tok_s
        r.decode_ratio = r.decode_tok_s / base.decode_tok_s
        r.step_ratio = r.step_tok_s / base.step_tok_s
        r.generate_ratio = _ratio(r.generate_tok_s, base.generate_tok_s)


def _generation_medians(runs: Sequence[measure.RunResult]) -> tuple[float | None, float | None]:
    """(decode tok/s, seconds to the first token) of the free generations, medians."""
    done = [x.generation for x in runs if x.generation is not None]
    if not done:
        return None, None
    return _median([g.decode_tok_s for g in done]), _median([g.first_s for g in done])


# -- interleaved ----------------------------------------------------------------------------
def explain(path: Path, args: argparse.Namespace, out: Out) -> dict[str, Any]:
    """The implementation bound to each layer declaration, grouped by implementation name."""
    report: dict[str, Any] = {}
    for reference in (False, True) if args.reference else (False,):
        arm = measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=_at_load(args), reference=reference
        )
        groups: dict[str, Counter[str]] = {}
        for module_path, impl in arm.bindings.items():
            pattern = re.sub(r"\.\d+(?=\.|$)", ".*", module_path)
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
    _progress("loading omnia")
    arms = [measure.omnia_arm(str(path), dtype=args.dtype, quantize=quantize, reference=False)]
    if getattr(args, "eager", False):
        _progress("loading omnia-eager (OMNIA_COMPILE=0)")
        arms.append(measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=quantize, reference=False, eager=True
        ))
    if getattr(args, "unchained", False):
        _progress("loading omnia-unchained (OMNIA_CHAINED_KERNELS=0)")
        arms.append(measure.omnia_arm(
            str(path), dtype=args.dtype, quantize=quantize, reference=False, chained=False
        ))
    if args.reference:
        _progress("loading omnia-reference (OMNIA_REFERENCE_KERNELS=1)")
        arms.append(
            measure.omnia_arm(str(path), dtype=args.dtype, quantize=quantize, reference=True)
        )
    if args.against == "mlx-lm":
        if env["mlx_lm"] is None:
            notes.append("mlx-lm arm skipped: mlx_lm is not importable (pip install mlx-lm==0.32.2)")
        else:
            _progress("loading mlx-lm")
            arms.append(measure.mlx_lm_arm(
                str(path), dtype=args.against_dtype or args.dtype, quantize=quantize
            ))
    return arms


def sampling_of(args: argparse.Namespace) -> measure.Sampling:
    return measure.Sampling(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def prompt_text(path: Path, ids: Sequence[int]) -> str:
    """The free generation's prompt: the prompt ids decoded by the checkpoint's tokenizer (the
    bench's vocabulary encodes it back to the same ids)."""
    tokenizers: Any = importlib.import_module("tokenizers")
    return cast(str, tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).decode(list(ids)))


def interleaved(args: argparse.Namespace, out: Out = print) -> dict[str, Any]:
    """Every arm in this process on one checkpoint and one token stream; runs rotate the order."""
    env = environment()
    quantize, on_disk = _at_load(args), _on_disk(args)
    with checkpoint(
        args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk
    ) as path:
        if args.explain:
            _print_environment(env, out)
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
        _progress(f"memory bandwidth ({args.bandwidth_mib} MiB)")
        bw = bandwidth.measure(args.bandwidth_mib * 2**20, backend=env.get("backend"))
        for arm in arms:
            _progress(f"warming up {arm.name}")
            measure.warm_up(arm, prompt, generate, text, sampling)
        results: dict[str, list[measure.RunResult]] = {a.name: [] for a in arms}
        orders: list[list[str]] = []
        for r in range(args.runs):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            orders.append([a.name for a in order])
            for arm in order:
                _progress(f"run {r + 1}/{args.runs}: {arm.name}")
                results[arm.name].append(measure.run_once(arm, prompt, generate, text, sampling))

        # One checkpoint: every arm's floor divides by the bytes the engine says a step reads.
        step_bytes = next((a.step_bytes for a in arms if a.step_bytes), 0)
        rows = [
            _row(arm.name, results[arm.name], len(prompt), arm.weight_bytes,
                 None if arm.name in unlike else (step_bytes or arm.weight_bytes), bw)
            for arm in arms
        ]
        baseline = "mlx-lm" if "mlx-lm" in results else arms[0].name
        _ratios(rows, baseline)
        tolerance = gate_tolerance(args.dtype, quantized=quantize is not None or on_disk is not None,
                                   backend=env.get("backend"))
        checks = _checks(arms[0].name, results, tolerance)

        _print_environment(env, out)
        source = f"random {args.model}" if not Path(args.model).is_dir() else str(path)
        q = "none" if quantize is None else f"affine {quantize[0]}-bit g{quantize[1]}"
        if on_disk is not None:
            q = f"affine {on_disk[0]}-bit g{on_disk[1]} (written quantized)"
        out(
            f"model: {source}  dtype {args.dtype}"
            + (f" (mlx-lm: {args.against_dtype})" if unlike else "")
            + f"  quantize {q}  prompt {len(prompt)}  "
            f"generate {len(generate)}  runs {args.runs}"
        )
        _print_bandwidth(bw, rows[0].step_bytes, out)
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
                "quantize": _quantize_json(quantize, on_disk),
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
                    "runs": [_run_json(x) for x in results[arm.name]],
                }
                for arm in arms
            },
            "table": [_row_json(r) for r in rows],
        }
    _write(report, args)
    return report


GENERATE_NOTE = ("generate = a free generation of {n} tokens through each engine's own API "
                 "(omnia Model.stream, mlx-lm stream_generate): temperature {temperature}, "
                 "top_p {top_p}, top_k {top_k}, seed {seed}, stop string {stop!r}; its decode "
                 "rate counts the tokens after the first text over the time after it")


def _spread_line(spread: dict[str, list[float]]) -> str:
    return "; ".join(
        f"{name} " + " ".join(f"{v:.2f}x" for v in values) for name, values in spread.items()
    )


def _row(
    name: str, runs: Sequence[measure.RunResult], prompt: int, weight_bytes: int,
    read: int | None, bw: bandwidth.Bandwidth,
) -> Row:
    gen_rate, first = _generation_medians(runs)
    return Row(
        arm=name,
        prefill_tok_s=prompt / _median([x.prefill_s for x in runs]),
        decode_tok_s=1.0 / _median([x.decode_pipelined_s for x in runs]),
        step_tok_s=1.0 / _median([x.decode_median_s for x in runs]),
        weight_bytes=weight_bytes,
        floor_tok_s=bw.best / read if read else None,
        step_bytes=read or 0,
        spec_floor_tok_s=bw.spec / read if read and bw.spec else None,
        generate_tok_s=gen_rate,
        first_token_s=first,
    )


def _run_json(x: measure.RunResult) -> dict[str, Any]:
    return {
        "prefill_s": x.prefill_s,
        "decode_median_s": x.decode_median_s,
        "decode_step_s": x.decode_step_s,
        "decode_pipelined_s": x.decode_pipelined_s,
        "generation": None if x.generation is None else x.generation.to_json(),
    }


def _print_bandwidth(bw: bandwidth.Bandwidth, step_bytes: int, out: Out) -> None:
    methods = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in bw.methods.items())
    spec = "no datasheet figure" if bw.spec is None else f"datasheet {bw.spec / 1e9:,.0f} GB/s"
    out(f"memory bandwidth: best {bw.best / 1e9:,.1f} GB/s ({methods} GB/s); {bw.card or 'no GPU'}, "
        f"{spec}. floor tok/s = best / the {step_bytes / 1e6:,.1f} MB a decode step reads")
    for name, error in bw.errors.items():
        out(f"copy method {name} failed: {error}")


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


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if getattr(args, "results", None):
        saved = results_file.save(report, Path(args.results))
        _progress(f"results written to {saved}")


def _quantize_json(
    at_load: tuple[int, int] | None, on_disk: tuple[int, int] | None
) -> dict[str, Any] | None:
    if on_disk is not None:
        return {"bits": on_disk[0], "group_size": on_disk[1], "on_disk": True}
    return None if at_load is None else {"bits": at_load[0], "group_size": at_load[1]}


def _row_json(r: Row) -> dict[str, Any]:
    return {
        "arm": r.arm,
        "prefill_tok_s": r.prefill_tok_s,
        "decode_tok_s": r.decode_tok_s,
        "step_tok_s": r.step_tok_s,
        "generate_tok_s": r.generate_tok_s,
        "first_token_s": r.first_token_s,
        "step_ratio": r.step_ratio,
        "prefill_ratio": r.prefill_ratio,
        "decode_ratio": r.decode_ratio,
        "generate_ratio": r.generate_ratio,
        "weight_bytes": r.weight_bytes,
        "step_bytes": r.step_bytes,
        "floor_tok_s": r.floor_tok_s,
        "floor_share": r.floor_share,
        "spec_floor_tok_s": r.spec_floor_tok_s,
        "spec_share": r.spec_share,
    }


# -- the correctness gate --------------------------------------------------------------------
# Significand bits of the float each arm rounds to. On CUDA, float32 matmuls may round their
# inputs to TF32 (10 stored bits, fp16's), so float32 counts as 11 bits there.
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
CUDA_FLOAT32_BITS = 11
# 2^slack units of the last place. In 16-bit formats the rounding of what is stored (weights,
# activations between layers) dominates: 2^4 covers ~30 layers of it with room to spare. In
# float32 the long reductions' own rounding dominates (terms in the thousands): 2^10.
SLACK_BITS = {"bfloat16": 4, "float16": 4, "float32": 10}
QUANTIZED_FACTOR = 2  # a quantized matrix is dequantized (rounded) once more


def gate_tolerance(dtype: str, *, quantized: bool, backend: str | None) -> float:
    """The largest logit difference two arms computing the same model may show, relative to
    the largest |logit| of the step: 2^(slack - p) for p significand bits (SLACK_BITS), twice
    that quantized. Fixed per dtype and format (as the parity tests' tolerance is fixed by the
    reference's precision), never measured from the arms it judges."""
    bits, slack = SIGNIFICAND_BITS[dtype], SLACK_BITS[dtype]
    if dtype == "float32" and backend == "cuda":
        bits, slack = CUDA_FLOAT32_BITS, SLACK_BITS["float16"]
    return 2.0 ** (slack - bits) * (QUANTIZED_FACTOR if quantized else 1)


def step_differences(
    ours: Sequence[dict[int, float]], theirs: Sequence[dict[int, float]]
) -> list[float]:
    """Per decode step: the largest |difference| of a token's logit between the arms, over the
    tokens both have among their top logits, relative to the step's largest |logit|."""
    out: list[float] = []
    for a, b in zip(ours, theirs, strict=True):
        shared = a.keys() & b.keys()
        scale = max((abs(v) for v in a.values()), default=0.0) or 1.0
        out.append(max((abs(a[t] - b[t]) for t in shared), default=0.0) / scale)
    return out


def gate(
    ref: measure.RunResult, run: measure.RunResult, tolerance: float
) -> dict[str, Any]:
    """Two arms computed the same model on the same ids. They pass when the last prompt row's
    logits and every decode step's top logits agree within `tolerance` (relative to the
    largest |logit|), and every step where their argmaxes differ is a near-tie: the reference's
    top-2 margin within twice the tolerance (each arm may be off by one tolerance)."""
    prefill_scale = float(np.max(np.abs(ref.prefill_last_logits))) or 1.0
    prefill = float(np.max(np.abs(run.prefill_last_logits - ref.prefill_last_logits)))
    steps = step_differences(ref.decode_top, run.decode_top)
    flips: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(ref.decode_argmax, run.decode_argmax, strict=True)):
        if x == y:
            continue
        top = ref.decode_top[i]
        scale = max((abs(v) for v in top.values()), default=0.0) or 1.0
        first, second = sorted(top.values(), reverse=True)[:2]
        margin = (first - second) / scale
        flips.append({"step": i, "margin": margin, "near_tie": margin <= 2 * tolerance})
    worst = max(steps, default=0.0)
    passed = (prefill / prefill_scale <= tolerance and worst <= tolerance
              and all(f["near_tie"] for f in flips))
    return {
        "tolerance": tolerance,
        "steps": len(steps),
        "argmax_agree": len(steps) - len(flips),
        "argmax_flips": flips,
        "decode_max_rel_diff": worst,
        "decode_rel_diff": steps,
        "prefill_last_argmax": [
            int(np.argmax(ref.prefill_last_logits)), int(np.argmax(run.prefill_last_logits))
        ],
        "prefill_logits_max_abs_diff": prefill,
        "prefill_logits_max_abs": prefill_scale,
        "prefill_max_rel_diff": prefill / prefill_scale,
        "passed": passed,
    }


def _checks(
    first: str, results: dict[str, list[measure.RunResult]], tolerance: float
) -> dict[str, dict[str, Any]]:
    """Each arm's first run against the first arm's, through the gate."""
    ref = results[first][0]
    return {
        name: gate(ref, runs[0], tolerance) for name, runs in results.items() if name != first
    }


# -- paired ---------------------------------------------------------------------------------
def _reference_tree(ref: str, into: Path) -> Path:
    """A tree with src/mlx_omnia: `ref` itself when it is such a directory, else the git
    revision `ref` of this checkout, extracted with `git archive` (no worktree, no checkout)."""
    given = Path(ref)
    if (given / "src" / "mlx_omnia").is_dir():
        return given.resolve()
    root = _source_root()
    try:
        data = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", ref, "src"],
            capture_output=True, check=True, timeout=120,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise SystemExit(
            f"--ref {ref!r}: not a tree with src/mlx_omnia and not a revision git can archive in "
            f"{root} ({detail.decode(errors='replace').strip() or e}); on a machine without the "
            "git history, extract it first: git archive REV src | tar -x -C bench-ref"
        ) from e
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _run_child(tree: Path, spec_file: Path, out_file: Path) -> dict[str, Any]:
    script = Path(measure.__file__).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run(
        [sys.executable, "-P", str(script), str(spec_file), str(out_file)], env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the bench arm under {tree} failed (exit {done.returncode})")
    result = cast(dict[str, Any], json.loads(out_file.read_text()))
    imported = Path(str(result["mlx_omnia_file"])).resolve()
    if not imported.is_relative_to(tree.resolve()):
        raise SystemExit(f"the arm for {tree} imported mlx_omnia from {imported}, not from that tree")
    return result


def paired(args: argparse.Namespace, out: Out = print) -> dict[str, Any]:
    """This tree against another revision, each arm in its own process (one process per run:
    a fresh process pays its own loads and warm-ups), runs alternated; medians and the ratio."""
    env = environment()
    quantize, on_disk = _at_load(args), _on_disk(args)
    work_tree = _source_root()
    with (
        checkpoint(
            args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk
        ) as path,
        tempfile.TemporaryDirectory(prefix="omnia-bench-paired-") as tmp,
    ):
        ref_tree = _reference_tree(args.ref, Path(tmp) / "ref")
        prompt, generate = token_stream(
            path, prompt=args.prompt, generate=args.generate, seed=args.seed
        )
        text = None if args.no_generation else prompt_text(path, prompt)
        sampling = sampling_of(args)
        spec = {
            "path": str(path), "dtype": args.dtype,
            "quantize": None if quantize is None else list(quantize),
            "reference": False, "prompt": prompt, "generate": generate, "runs": 1,
            "text": text, "sampling": None if text is None else sampling.to_json(),
        }
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        _progress(f"memory bandwidth ({args.bandwidth_mib} MiB)")
        bw = bandwidth.measure(args.bandwidth_mib * 2**20, backend=env.get("backend"))
        trees = {"working": work_tree, f"ref {args.ref}": ref_tree}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        names = list(trees)
        for r in range(args.runs):
            for name in names[r % 2:] + names[: r % 2]:
                _progress(f"run {r + 1}/{args.runs}: {name} ({trees[name]})")
                child = _run_child(trees[name], spec_file, Path(tmp) / "out.json")
                results[name].append(child)

    rows: list[Row] = []
    for name in names:
        runs = [run for child in results[name] for run in child["runs"]]
        weight_bytes = int(results[name][0]["weight_bytes"])
        read = int(results[name][0].get("step_bytes", 0)) or weight_bytes
        gens = [measure.GenerationRun(**x["generation"]) for x in runs if x.get("generation")]
        rows.append(Row(
            arm=name,
            prefill_tok_s=len(prompt) / _median([float(x["prefill_s"]) for x in runs]),
            decode_tok_s=1.0 / _median([float(x.get("decode_pipelined_s", "nan")) for x in runs]),
            step_tok_s=1.0 / _median([_median(x["decode_step_s"]) for x in runs]),
            weight_bytes=weight_bytes,
            floor_tok_s=bw.best / read if read else None,
            step_bytes=read,
            spec_floor_tok_s=bw.spec / read if read and bw.spec else None,
            generate_tok_s=_median([g.decode_tok_s for g in gens]) if gens else None,
            first_token_s=_median([g.first_s for g in gens]) if gens else None,
        ))
    _ratios(rows, names[1])
    first_runs = [results[name][0]["runs"][0] for name in names]
    same = first_runs[0]["decode_argmax"] == first_runs[1]["decode_argmax"]
    _print_environment(env, out)
    out(f"model: {args.model}  dtype {args.dtype}  prompt {len(prompt)}  generate {len(generate)}  "
        f"runs {args.runs}  working {_git_revision(work_tree) or work_tree}  ref {args.ref}")
    _print_bandwidth(bw, rows[0].step_bytes, out)
    out(f"check: decode argmax streams {'identical' if same else 'DIFFER'} between the trees")
    out(DECODE_NOTE)
    if text is not None:
        out(GENERATE_NOTE.format(**sampling.to_json(), n=len(generate)))
    out("")
    out(table(rows, "ref"))
    report: dict[str, Any] = {
        "command": "paired",
        "environment": env,
        "ref": args.ref,
        "model": {"source": args.model, "shape": None if Path(args.model).is_dir() else args.model},
        "options": {"dtype": args.dtype, "quantize": _quantize_json(quantize, on_disk),
                    "prompt": len(prompt), "generate": len(generate), "runs": args.runs,
                    "seed": args.seed, "like_for_like": True,
                    "sampling": None if text is None else sampling.to_json()},
        "bandwidth": bw.to_json(),
        "copy_bandwidth_bytes_per_s": bw.best,
        "argmax_identical": same,
        "arms": results,
        "table": [_row_json(r) for r in rows],
    }
    _write(report, args)
    return report


# -- the command line -----------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, *, default_mib: int) -> None:
    p.add_argument("--model", required=True,
                   help=f"a checkpoint directory, or a shape to build with random weights: {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                   help="affine-quantize at load, both arms the same way (bits)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--prequantize", action="store_true",
                   help="with --quantize and a named shape: write the random checkpoint already "
                        "quantized (MLX layout), which the arms load as is; a 30B MoE then fits "
                        "a 64 GB disk (~17 GB at 4 bits, ~61 GB at bfloat16)")
    p.add_argument("--prompt", type=int, default=512, help="prompt length in tokens")
    p.add_argument("--generate", type=int, default=128, help="teacher-forced decode steps")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="for the random weights and token ids")
    p.add_argument("--json", default=None, metavar="OUT", help="write the details here")
    p.add_argument("--workdir", default=None, help="where random checkpoints are built (a temp dir)")
    p.add_argument("--bandwidth-mib", type=int, default=default_mib,
                   help="size of the array copied to measure bandwidth")
    p.add_argument("--no-generation", action="store_true",
                   help="leave out the free generation (stream API) of each run")
    p.add_argument("--temperature", type=float, default=measure.Sampling.temperature,
                   help="the free generation's sampling (both engines the same)")
    p.add_argument("--top-p", type=float, default=measure.Sampling.top_p)
    p.add_argument("--top-k", type=int, default=measure.Sampling.top_k)
    p.add_argument("--results", default=None, metavar="DIR",
                   help="also write the JSON under DIR with a name from its date, revision, "
                        "device and model (docs/bench-results/ holds the published ones)")


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
    return top


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    if args.prompt < 1 or args.generate < 1 or args.runs < 1:
        raise SystemExit("--prompt, --generate and --runs must be at least 1")
    stream = out or sys.stdout

    def write(line: str) -> None:
        print(line, file=stream, flush=True)

    if args.command == "paired":
        paired(args, write)
    else:
        interleaved(args, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
