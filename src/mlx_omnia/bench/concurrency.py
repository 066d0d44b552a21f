"""`omnia-bench concurrency`: many streams decoded together. At each stream count, all streams
are added at once to the engine's `Batch` and to mlx-lm's `BatchGenerator` on the same
checkpoint, in one process, the arms taking turns within each run (the order rotates). Every
stream generates exactly --generate tokens: the engine bans the end tokens (logit_bias -100, the
only way through its API to run past them), mlx-lm gets no stop tokens. Reported per stream
count: the aggregate decode rate, each stream's time to first token and mean inter-token time,
and the prefill of all streams separately."""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_omnia import Batch, GenerationOptions, Model, load
from mlx_omnia.bench import common, measure
from mlx_omnia.bench.common import (
    Out,
    at_load,
    checkpoint,
    environment,
    median,
    print_environment,
    progress,
    quantize_json,
    quantize_text,
    random_words,
    sampling_of,
    vocabulary_words,
    write_report,
    written_quantized,
)

BAN = -100.0  # OpenAI's logit_bias for "never": the end tokens, so every stream runs its length


@dataclass
class Stream:
    """When one stream's tokens were handed out: (seconds since the streams were added,
    tokens) for each step that handed some out."""

    arrivals: list[tuple[float, int]] = field(default_factory=list[tuple[float, int]])
    finish: str = "?"

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def first_s(self) -> float:
        return self.arrivals[0][0] if self.arrivals else float("nan")

    @property
    def inter_token_s(self) -> float:
        """The mean time between tokens after the first step's (nan under two tokens)."""
        after = self.tokens - self.arrivals[0][1] if self.arrivals else 0
        return (self.arrivals[-1][0] - self.arrivals[0][0]) / after if after > 0 else float("nan")


@dataclass
class Run:
    """All streams of one arm at one stream count."""

    streams: list[Stream]
    prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def first_s(self) -> float:
        """The first token of any stream: the end of the first prefill."""
        return min(s.first_s for s in self.streams)

    @property
    def prefill_s(self) -> float:
        """From adding the streams to the last stream's first token: every prompt prefilled."""
        return max(s.first_s for s in self.streams)

    @property
    def last_s(self) -> float:
        return max(s.arrivals[-1][0] for s in self.streams if s.arrivals)

    @property
    def decode_tok_s(self) -> float:
        """Aggregate rate: the tokens handed out after the step of the first one, over the time
        from that step to the last token (later streams' prefills included, interleaved)."""
        first = self.first_s
        after = sum(n for s in self.streams for t, n in s.arrivals if t > first)
        return after / (self.last_s - first) if self.last_s > first else float("nan")

    @property
    def steady_tok_s(self) -> float:
        """The tokens handed out after every stream had its first one, over that time to the
        last token: no prefill, but the tail where early streams have finished."""
        ready = self.prefill_s
        after = sum(n for s in self.streams for t, n in s.arrivals if t > ready)
        return after / (self.last_s - ready) if self.last_s > ready else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.total_tokens,
            "first_s": self.first_s,
            "prefill_s": self.prefill_s,
            "last_s": self.last_s,
            "decode_tok_s": self.decode_tok_s,
            "steady_tok_s": self.steady_tok_s,
            "streams": [{"tokens": s.tokens, "first_s": s.first_s,
                         "inter_token_s": s.inter_token_s, "finish": s.finish,
                         "steps": len(s.arrivals)} for s in self.streams],
        }


# run(streams, tokens each) -> one timed run of the first `streams` prompts
Arm = Callable[[int, int], Run]


def omnia_arm(model: Model, texts: Sequence[str], sampling: measure.Sampling) -> Arm:
    """The engine: one `Batch`, every stream added at once (its raw prompt text), stepped until
    all have ended."""
    ban = dict.fromkeys(sorted(model.tokenizer.eos_token_ids), BAN)

    def run(n: int, tokens: int) -> Run:
        batch = Batch(model)
        start = time.perf_counter()
        streams = {
            batch.add(text, GenerationOptions(
                max_tokens=tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=sampling.seed + i, logit_bias=ban,
            )): Stream()
            for i, text in enumerate(texts[:n])
        }
        prompt_tokens = 0
        while len(batch):
            events = batch.step()
            now = time.perf_counter() - start
            for generation, event in events:
                if isinstance(event, Exception):
                    raise event
                stream = streams[generation]
                if n := sum(len(p.token_ids) for p in event):
                    stream.arrivals.append((now, n))
                if event and event[-1].finish_reason is not None:
                    stream.finish = event[-1].finish_reason
                    usage = event[-1].usage
                    prompt_tokens += usage.prompt_tokens if usage else 0
        return Run(list(streams.values()), prompt_tokens)

    return run


def mlx_lm_arm(model: Any, prompts: Sequence[Sequence[int]], sampling: measure.Sampling) -> Arm:
    """mlx-lm: one `BatchGenerator` (its defaults: prefill 8 prompts at a time; a completion
    batch of 32, or all streams when more), no stop tokens, one sampler for all streams
    (make_sampler), every prompt inserted at once as the engine's token ids."""
    generate: Any = importlib.import_module("mlx_lm.generate")
    sample_utils: Any = importlib.import_module("mlx_lm.sample_utils")
    sampler = sample_utils.make_sampler(
        temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
    )

    def run(n: int, tokens: int) -> Run:
        mx.random.seed(sampling.seed)
        gen = generate.BatchGenerator(
            model, max_tokens=tokens, stop_tokens=None, sampler=sampler,
            completion_batch_size=max(32, n),
        )
        start = time.perf_counter()
        uids = cast(list[int], gen.insert([list(p) for p in prompts[:n]], [tokens] * n))
        out = {uid: Stream() for uid in uids}
        left = len(uids)
        while left:
            _, responses = gen.next()
            now = time.perf_counter() - start
            for r in responses:
                stream = out[int(r.uid)]
                stream.arrivals.append((now, 1))
                if r.finish_reason is not None:
                    stream.finish = str(r.finish_reason)
                    left -= 1
        gen.close()
        return Run([out[u] for u in uids], sum(len(p) for p in prompts[:n]))

    return run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", default="1,2,4,8,16,32",
                   help="the stream counts, comma-separated")
    p.add_argument("--against", choices=["mlx-lm", "none"], default="mlx-lm",
                   help="the baseline arm (skipped, with a note, when mlx_lm is not importable)")
    p.set_defaults(prompt=128)


def stream_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise SystemExit(f"--streams {text!r}: give positive integers, comma-separated (1,2,4,8)")
    return counts


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:,.1f}"


def _row(arm: str, n: int, runs: Sequence[Run]) -> dict[str, Any]:
    every = [s for r in runs for s in r.streams]
    return {
        "arm": arm,
        "streams": n,
        "decode_tok_s": median([r.decode_tok_s for r in runs]),
        "steady_tok_s": median([r.steady_tok_s for r in runs]),
        "prefill_s": median([r.prefill_s for r in runs]),
        "first_token_median_s": median([s.first_s for s in every]),
        "first_token_max_s": max(s.first_s for s in every),
        "inter_token_median_s": median([s.inter_token_s for s in every]),
        "inter_token_max_s": max(s.inter_token_s for s in every),
        "tokens": min(r.total_tokens for r in runs),
        "prompt_tokens": min(r.prompt_tokens for r in runs),
        "finish": sorted({s.finish for s in every}),
        "ratio": None,
    }


def _problems(rows: Sequence[dict[str, Any]], generate: int) -> list[str]:
    """Every stream ran its whole length, and both arms read the same prompt tokens."""
    problems: list[str] = []
    for row in rows:
        where = f"{row['arm']} at {row['streams']} streams"
        if row["tokens"] != row["streams"] * generate:
            problems.append(f"{where}: {row['tokens']} tokens, not {row['streams'] * generate}")
        if row["finish"] != ["length"]:
            problems.append(f"{where}: finish reasons {row['finish']}, not only length")
        first = next(r for r in rows if r["streams"] == row["streams"])
        if row["prompt_tokens"] != first["prompt_tokens"]:
            problems.append(f"{where}: {row['prompt_tokens']} prompt tokens, {first['arm']} "
                            f"{first['prompt_tokens']}")
    return problems


def concurrency(args: argparse.Namespace, out: Out) -> dict[str, Any]:
    """Both engines decoding 1, 2, 4... streams at once, interleaved on one checkpoint."""
    counts = stream_counts(args.streams)
    env = environment()
    quantize, on_disk = at_load(args), written_quantized(args)
    sampling = sampling_of(args)
    notes: list[str] = []
    with checkpoint(
        args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk,
        layers=args.layers,
    ) as path:
        # One prompt per stream (of the largest count): --prompt random words of the
        # vocabulary, a token each.
        words, rng = vocabulary_words(path), np.random.default_rng(args.seed)
        texts = [random_words(words, args.prompt, rng) for _ in range(max(counts))]
        progress("loading omnia")
        q = None if quantize is None else {"bits": quantize[0], "group_size": quantize[1]}
        model = load(str(path), dtype=args.dtype, quantize=q)
        prompts = [model.encode(t) for t in texts]  # both engines get the engine's ids
        arms: dict[str, Arm] = {"omnia": omnia_arm(model, texts, sampling)}
        if args.against == "mlx-lm":
            if env["mlx_lm"] is None:
                notes.append("mlx-lm arm skipped: mlx_lm is not importable "
                             "(pip install mlx-lm==0.32.2)")
            else:
                progress("loading mlx-lm")
                theirs, _ = measure.mlx_lm_model(str(path), dtype=args.dtype, quantize=quantize)
                arms["mlx-lm"] = mlx_lm_arm(theirs, prompts, sampling)
        names = list(arms)
        for n in counts:
            for name in names:
                progress(f"warming up {name} at {n} streams")
                arms[name](n, args.generate)
        results: dict[str, dict[int, list[Run]]] = {a: {n: [] for n in counts} for a in names}
        orders: list[list[str]] = []
        for r in range(args.runs):
            order = names[r % len(names):] + names[: r % len(names)]
            orders.append(order)
            for n in counts:
                for name in order:
                    progress(f"run {r + 1}/{args.runs}: {name}, {n} streams")
                    results[name][n].append(arms[name](n, args.generate))
        config = json.loads((path / "config.json").read_text())

    source = common.model_source(args.model, path, args.layers)
    report = _report(args, env, config, source, quantize, on_disk, sampling, results, orders,
                     notes)
    rows, baseline, problems = report["table"], report["baseline"], report["problems"]
    ratio_per_run = cast(dict[str, list[float]], report["ratio_per_run"])
    print_environment(env, out)
    out(f"model: {source}  dtype {args.dtype}  quantize {quantize_text(quantize, on_disk)}  "
        f"prompt {args.prompt} words ({len(prompts[0])} tokens, stream 1)  generate "
        f"{args.generate}  streams {','.join(map(str, counts))}  runs {args.runs}")
    out(f"sampling: temperature {sampling.temperature}, top_p {sampling.top_p}, top_k "
        f"{sampling.top_k}, seed {sampling.seed} (+ the stream's index in omnia); every stream "
        f"runs {args.generate} tokens (omnia: end tokens banned by logit_bias; mlx-lm: no stop "
        "tokens)")
    out("decode tok/s = all streams' tokens after the first one handed out / the time from it to "
        "the last (later streams' prefills included); steady = the same after every stream had "
        "its first token; prefill = adding the streams to the last one's first token; first "
        "token and inter-token (a stream's mean) are medians / maxima over streams and runs; "
        "vs mlx-lm: the median of each run's own decode ratio")
    for note in notes:
        out(note)
    for problem in problems:
        out(f"CHECK FAILED: {problem}")
    out("")
    out(_table(rows, baseline))
    if baseline is not None and args.runs > 1:
        out("omnia vs mlx-lm, run by run: " + "; ".join(
            f"{n} streams " + " ".join(f"{v:.2f}x" for v in ratio_per_run[str(n)])
            for n in counts))

    write_report(report, args)
    return report


def _report(
    args: argparse.Namespace, env: dict[str, Any], config: dict[str, Any], source: str,
    quantize: tuple[int, int] | None, on_disk: tuple[int, int] | None,
    sampling: measure.Sampling, results: dict[str, dict[int, list[Run]]],
    orders: list[list[str]], notes: list[str],
) -> dict[str, Any]:
    """The JSON report of every arm's runs at every stream count ({arm: {streams: runs}}):
    a row per stream count and arm, each run's omnia / mlx-lm decode ratio, the checks."""
    names, counts = list(results), list(next(iter(results.values())))
    baseline = "mlx-lm" if "mlx-lm" in names else None
    rows = [_row(name, n, results[name][n]) for n in counts for name in names]
    ratio_per_run: dict[str, list[float]] = {}
    if baseline is not None:
        for n in counts:
            ratio_per_run[str(n)] = [
                x.decode_tok_s / b.decode_tok_s
                for x, b in zip(results["omnia"][n], results[baseline][n], strict=True)
            ]
        for row in rows:
            row["ratio"] = 1.0 if row["arm"] == baseline else median(
                ratio_per_run[str(row["streams"])])
    problems = _problems(rows, args.generate)
    return {
        **common.report_head("concurrency", env, source, args.model, config),
        "options": {
            "dtype": args.dtype,
            "like_for_like": True,  # one checkpoint, one format, the same prompts and lengths
            "quantize": quantize_json(quantize, on_disk),
            "layers": common.layers_json(args.model, args.layers),
            "prompt": args.prompt,
            "generate": args.generate,
            "streams": counts,
            "runs": args.runs,
            "seed": args.seed,
            "sampling": sampling.to_json() | {"stop": None, "end_tokens_banned": BAN},
        },
        "notes": notes,
        "baseline": baseline,
        "run_orders": orders,
        "ratio_per_run": ratio_per_run,
        "passed": not problems,
        "problems": problems,
        "arms": {name: {str(n): [x.to_json() for x in results[name][n]] for n in counts}
                 for name in names},
        "table": rows,
    }


def _table(rows: Sequence[dict[str, Any]], baseline: str | None) -> str:
    head = ("streams", "arm", "decode tok/s", "steady tok/s", f"vs {baseline or '-'}",
            "prefill ms", "first token ms (median / max)", "inter-token ms (median / max)")
    body = [
        (
            str(r["streams"]), r["arm"], f"{r['decode_tok_s']:,.1f}", f"{r['steady_tok_s']:,.1f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", _ms(r["prefill_s"]),
            f"{_ms(r['first_token_median_s'])} / {_ms(r['first_token_max_s'])}",
            f"{_ms(r['inter_token_median_s'])} / {_ms(r['inter_token_max_s'])}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])

