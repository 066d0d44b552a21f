"""`omnia-bench constrained`: what grammar-constrained decoding costs. The model is loaded once;
free generations with no constraint and under each grammar take turns in one process (same
prompt, sampling and seed), so each constrained rate is compared with the free one of its own
run. Every constrained answer is checked against its grammar, and its tokens are replayed
through llguidance alone to time the host's work per token (consume it, compute the mask)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from mlx_omnia import Constraint, GenerationOptions, Model, load
from mlx_omnia.bench import common, measure
from mlx_omnia.bench.common import (
    Out,
    at_load,
    checkpoint,
    environment,
    median,
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

GRAMMARS = ("json", "regex", "lark")
ITEM_CHARS = 8  # the JSON arm's strings hold 1 to 8 characters
# In the bench's vocabulary no token holds a quote beside another character, so each string of
# the JSON arm takes at least 5 tokens (its quotes, a character, a comma and a space): ~N / 5
# strings keep the answer going past N tokens, and it still ends on its own, to be parsed.
MIN_ITEM_TOKENS = 5
WORDS = re.compile(r"(?: [a-z]+)* ?")  # every cut of the regex and lark arms' text


@dataclass(frozen=True)
class Arm:
    """One kind of generation: its constraint (None: free), its token limit, and what its text
    must be (`check` names the problem, or returns None)."""

    name: str
    constraint: Constraint | None
    max_tokens: int
    check: Callable[[str, str], str | None]  # (text, finish reason) -> problem


def arms(n: int, grammars: Sequence[str]) -> list[Arm]:
    """The free arm, then each grammar sized so that no answer can end before `n` tokens."""
    items = n // MIN_ITEM_TOKENS + 1
    schema = {"type": "array", "minItems": items, "maxItems": items,
              "items": {"type": "string", "minLength": 1, "maxLength": ITEM_CHARS}}

    def strings(text: str, finish: str) -> str | None:
        if finish != "stop":
            return f"the array did not end (finish {finish})"
        try:
            value: object = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        if not isinstance(value, list) or len(cast(list[object], value)) != items:
            return f"not an array of {items} items"
        for item in cast(list[object], value):
            if not isinstance(item, str) or not 1 <= len(item) <= ITEM_CHARS:
                return f"item {item!r} is not a string of 1 to {ITEM_CHARS} characters"
        return None

    def words(text: str, finish: str) -> str | None:
        return None if WORDS.fullmatch(text) else f"{text[:60]!r}... is not words of a-z"

    def free(text: str, finish: str) -> str | None:
        return None

    every = {
        # The limit leaves room for the longest answer: each character a 6-token escape.
        "json": Arm("json", Constraint.json_schema(schema), 2 + items * (4 + 6 * ITEM_CHARS),
                    strings),
        "regex": Arm("regex", Constraint.regex(f"( [a-z]+){{{n},}}"), n, words),
        "lark": Arm("lark", Constraint.lark(f"start: WORD{{{n},}}\nWORD: / [a-z]+/"), n, words),
    }
    return [Arm("free", None, n, free), *(every[g] for g in grammars)]


@dataclass
class Answer:
    """One generation: its first `n` tokens timed (`run`), and all it wrote."""

    run: measure.GenerationRun
    token_ids: list[int]
    text: str
    finish: str


def generate(model: Model, text: str, options: GenerationOptions, n: int) -> Answer:
    """Stream one answer, timing the pieces up to its n-th token as `interleaved` times a free
    generation; the rest (a JSON answer's end) is read untimed."""
    clock = measure.Clock()
    ids: list[int] = []
    parts: list[str] = []
    finish, prompt_tokens = "?", 0
    for piece in model.stream(text, options):
        if clock.tokens < n:
            clock.arrived(len(piece.token_ids), len(piece.text))
        ids.extend(piece.token_ids)
        parts.append(piece.text)
        if piece.finish_reason is not None:
            finish = piece.finish_reason
            prompt_tokens = piece.usage.prompt_tokens if piece.usage else 0
    return Answer(clock.run(prompt_tokens, finish), ids, "".join(parts), finish)


@dataclass
class MaskTimes:
    """llguidance alone on the host, over an answer's tokens, as the sampler runs it: compile
    the grammar, compute the first mask, then for each token consume it and compute the next."""

    compile_s: float
    first_mask_s: float
    per_token_s: list[float] = field(default_factory=list[float])
    refused: int | None = None  # the index of the first token the grammar refused
    accepting: bool = False  # the grammar may end after the last token

    def to_json(self) -> dict[str, Any]:
        t = self.per_token_s
        return {"compile_s": self.compile_s, "first_mask_s": self.first_mask_s,
                "tokens": len(t), "median_s": median(t),
                "mean_s": statistics.fmean(t) if t else float("nan"),
                "p90_s": float(np.percentile(t, 90)) if t else float("nan"),
                "max_s": max(t, default=float("nan")),
                "refused": self.refused, "accepting": self.accepting}


def replay(tokenizer: LLTokenizer, constraint: Constraint, ids: Sequence[int]) -> MaskTimes:
    start = time.perf_counter()
    matcher = LLMatcher(tokenizer, constraint.grammar(), log_level=0)
    compiled = time.perf_counter()
    words = np.zeros(((tokenizer.vocab_size + 31) // 32,), np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    times = MaskTimes(compiled - start, time.perf_counter() - compiled)
    ends = frozenset(tokenizer.eos_tokens)
    for i, token in enumerate(ids):
        start = time.perf_counter()
        if not matcher.consume_token(token):
            times.refused = i
            break
        if token in ends:  # nothing follows an end token: no mask to compute
            break
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        times.per_token_s.append(time.perf_counter() - start)
    times.accepting = matcher.is_accepting() and not matcher.is_error()
    return times


@dataclass
class Run:
    answer: Answer
    mask: MaskTimes | None
    problem: str | None

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.answer.run.to_json(),
                "decode_tok_s": self.answer.run.decode_tok_s,
                "tokens_written": len(self.answer.token_ids), "finish": self.answer.finish,
                "text_head": self.answer.text[:120],
                "mask": None if self.mask is None else self.mask.to_json(),
                "problem": self.problem}


def run_arm(model: Model, arm: Arm, text: str, options: GenerationOptions, n: int) -> Run:
    answer = generate(model, text, options, n)
    problem = None
    if answer.run.tokens < n:
        problem = f"ended early: {answer.run.tokens} of {n} tokens ({answer.finish})"
    mask = None
    if arm.constraint is not None:
        mask = replay(model.grammar_tokenizer(), arm.constraint, answer.token_ids)
        if mask.refused is not None:
            problem = problem or f"llguidance refuses token {mask.refused} of the answer"
    problem = problem or arm.check(answer.text, answer.finish)
    return Run(answer, mask, problem)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--constraints", default=",".join(GRAMMARS),
                   help=f"the constrained arms, comma-separated, from {', '.join(GRAMMARS)}")


def _micro(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e6:,.0f}"


def constrained(args: argparse.Namespace, out: Out) -> dict[str, Any]:
    """Free and constrained generations of --generate tokens, interleaved on one loaded model."""
    grammars = [g for g in args.constraints.split(",") if g]
    if unknown := [g for g in grammars if g not in GRAMMARS]:
        raise SystemExit(f"--constraints: unknown {', '.join(unknown)} (known: {', '.join(GRAMMARS)})")
    n = args.generate
    env = environment()
    quantize, on_disk = at_load(args), written_quantized(args)
    with checkpoint(
        args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk,
        layers=args.layers,
    ) as path:
        prompt, _ = token_stream(path, prompt=args.prompt, generate=1, seed=args.seed)
        text = prompt_text(path, prompt)
        sampling = sampling_of(args)
        progress("loading omnia")
        q = None if quantize is None else {"bits": quantize[0], "group_size": quantize[1]}
        model = load(str(path), dtype=args.dtype, quantize=q)
        every = arms(n, grammars)

        def options(arm: Arm, max_tokens: int) -> GenerationOptions:
            return GenerationOptions(
                max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=sampling.seed, stop=[sampling.stop],
                constraint=arm.constraint,
            )

        for arm in every:
            progress(f"warming up {arm.name}")
            generate(model, text, options(arm, min(n, 8)), n)
        runs: dict[str, list[Run]] = {a.name: [] for a in every}
        orders: list[list[str]] = []
        for r in range(args.runs):
            order = every[r % len(every):] + every[: r % len(every)]
            orders.append([a.name for a in order])
            for arm in order:
                progress(f"run {r + 1}/{args.runs}: {arm.name}")
                runs[arm.name].append(run_arm(model, arm, text, options(arm, arm.max_tokens), n))
        config = json.loads((path / "config.json").read_text())

    ratios = {a.name: [x.answer.run.decode_tok_s / f.answer.run.decode_tok_s
                       for x, f in zip(runs[a.name], runs["free"], strict=True)] for a in every}
    added = {a.name: [1 / x.answer.run.decode_tok_s - 1 / f.answer.run.decode_tok_s
                      for x, f in zip(runs[a.name], runs["free"], strict=True)] for a in every}
    rows: list[dict[str, Any]] = []
    for arm in every:
        done = runs[arm.name]
        masks = [x.mask for x in done if x.mask is not None]
        pooled = [t for m in masks for t in m.per_token_s]
        problems = [x.problem for x in done if x.problem]
        rows.append({
            "arm": arm.name,
            "constraint": None if arm.constraint is None else arm.constraint.kind,
            "decode_tok_s": median([x.answer.run.decode_tok_s for x in done]),
            "ratio": median(ratios[arm.name]),
            "added_s_per_token": median(added[arm.name]),
            "first_s": median([x.answer.run.first_s for x in done]),
            "tokens_timed": min(x.answer.run.tokens for x in done),
            "tokens_written": max(len(x.answer.token_ids) for x in done),
            "mask_compile_s": median([m.compile_s for m in masks]) if masks else None,
            "mask_median_s": median([median(m.per_token_s) for m in masks]) if masks else None,
            "mask_p90_s": float(np.percentile(pooled, 90)) if pooled else None,
            "mask_max_s": max(pooled) if pooled else None,
            "passed": not problems,
            "problems": problems,
        })

    source = common.model_source(args.model, path, args.layers)
    print_environment(env, out)
    out(f"model: {source}  dtype {args.dtype}  quantize {quantize_text(quantize, on_disk)}  "
        f"prompt {len(prompt)}  "
        f"generate {n}  runs {args.runs}")
    out(f"free generations of {n} tokens (Model.stream, temperature {sampling.temperature}, "
        f"top_p {sampling.top_p}, top_k {sampling.top_k}, seed {sampling.seed}); tok/s counts "
        "the tokens after the first text over the time after it, up to the n-th token")
    for arm in every:
        if arm.constraint is not None:
            out(f"  {arm.name}: {arm.constraint.kind} {arm.constraint.source!r}")
    out("ratio and +us/token: against the free arm of the same run (median of runs); mask "
        "us: llguidance alone replaying the answer (consume a token, compute the next mask), "
        "which the loop runs on the host while the device computes the next forward")
    out("")
    out("| arm | tok/s | vs free | +us/token | first token ms | grammar compile ms | "
        "mask us median / p90 / max | tokens timed / written | check |")
    out("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        mask = ("-" if row["mask_median_s"] is None else " / ".join(
            _micro(row[k]) for k in ("mask_median_s", "mask_p90_s", "mask_max_s")))
        compile_ms = "-" if row["mask_compile_s"] is None else f"{row['mask_compile_s'] * 1e3:.2f}"
        out(f"| {row['arm']} | {row['decode_tok_s']:,.1f} | {row['ratio']:.3f}x | "
            f"{_micro(row['added_s_per_token'])} | {row['first_s'] * 1e3:,.1f} | {compile_ms} | "
            f"{mask} | {row['tokens_timed']} / {row['tokens_written']} | "
            f"{'ok' if row['passed'] else 'FAIL: ' + row['problems'][0]} |")
    if args.runs > 1:
        out("vs free, run by run: " + "; ".join(
            f"{a.name} " + " ".join(f"{v:.3f}x" for v in ratios[a.name])
            for a in every if a.constraint is not None))

    report: dict[str, Any] = {
        **common.report_head("constrained", env, source, args.model, config),
        "options": {
            "dtype": args.dtype,
            "like_for_like": True,  # one model, one format: the arms differ in the constraint
            "quantize": quantize_json(quantize, on_disk),
            "layers": common.layers_json(args.model, args.layers),
            "prompt": len(prompt),
            "generate": n,
            "runs": args.runs,
            "seed": args.seed,
            "sampling": sampling.to_json(),
            "constraints": {a.name: {"kind": a.constraint.kind, "source": a.constraint.source,
                                     "max_tokens": a.max_tokens}
                            for a in every if a.constraint is not None},
        },
        "run_orders": orders,
        "ratio_per_run": ratios,
        "added_s_per_token_per_run": added,
        "passed": all(row["passed"] for row in rows),
        "arms": {name: {"runs": [x.to_json() for x in done]} for name, done in runs.items()},
        "table": rows,
    }
    write_report(report, args)
    return report
