"""Arms and their timing: load a checkpoint one way, feed it a fixed token stream, time it.

Self-contained on purpose (imports only `mlx_omnia`'s public API, MLX and mlx-lm): `omnia-bench
paired` runs this file as a script under another tree's `src`, which has no bench package.

    python -P measure.py SPEC.json OUT.json     # one arm, as `paired` starts it
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx_omnia
from mlx_omnia import GenerationOptions, load  # the engine first: it loads the system BLAS (Linux)

# isort: split
import mlx.core as mx
import numpy as np

FORCE_REFERENCE_ENV = "OMNIA_REFERENCE_KERNELS"
CHAINED_ENV = "OMNIA_CHAINED_KERNELS"
MLX_LM_PREFILL_STEP = 2048  # generate_step's default prefill_step_size (mlx-lm 0.32)

# feed(ids) -> (logits whose last row is the last id's, cache arrays): lazy, the caller evaluates
# them together. One id is one decode step; several are a prompt, prefilled as each engine's
# generation prefills one: the head (a vocabulary-sized matmul) runs for the last id alone.
Feed = Callable[[Sequence[int]], tuple[mx.array, list[mx.array]]]


def evaluate(*arrays: mx.array | list[mx.array]) -> None:
    """mx.eval with typed arguments (the stub leaves *args untyped)."""
    mx.eval(*arrays)  # pyright: ignore[reportUnknownMemberType]  # stub: *args untyped


@dataclass(frozen=True)
class Sampling:
    """What a free generation asks of both engines: the same sampling settings, the same seed
    and a stop string (that random weights never write) which each engine must watch for."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    seed: int = 0
    stop: str = "\n\nUser:"

    def to_json(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "stop": self.stop}


@dataclass
class GenerationRun:
    """One free generation through an engine's own generation API: sampled tokens,
    detokenized, stop strings matched, as its users run it."""

    first_s: float       # from the call to the first token's text (prefill + first sample)
    decode_s: float      # from the first token's text to the last's
    tokens: int          # generated tokens
    first_tokens: int    # tokens that arrived with the first text
    prompt_tokens: int
    chars: int
    finish: str

    @property
    def decode_tok_s(self) -> float:
        after = self.tokens - self.first_tokens
        return after / self.decode_s if after > 0 and self.decode_s > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"first_s": self.first_s, "decode_s": self.decode_s, "tokens": self.tokens,
                "first_tokens": self.first_tokens, "prompt_tokens": self.prompt_tokens,
                "chars": self.chars, "finish": self.finish}


# generate(prompt text, new tokens, sampling) -> one timed free generation
Generate = Callable[[str, int, Sampling], GenerationRun]


@dataclass
class Arm:
    """One way of running the checkpoint: a name, its weight bytes, fresh sequences, and free
    generation. `step_bytes`: the weights one decode step reads (the engine's
    Model.decode_bytes: the routed experts' share, one row of an untied embedding table); 0
    when the arm cannot say. `dtype`: the activations' dtype it was loaded in."""

    name: str
    weight_bytes: int
    new_sequence: Callable[[], Feed]
    bindings: dict[str, str] = field(default_factory=dict[str, str])
    step_bytes: int = 0
    generate: Generate | None = None
    dtype: str = ""


@dataclass
class RunResult:
    prefill_s: float
    decode_step_s: list[float]
    # For the cross-arm check (not timed): last prompt row's logits and each step's argmax.
    prefill_last_logits: np.ndarray[Any, np.dtype[np.float32]]
    decode_argmax: list[int]
    # Each step's TOP_K highest logits: {token id: logit}, for the margin-aware agreement.
    decode_top: list[dict[int, float]] = field(default_factory=list[dict[int, float]])
    # Seconds per decode step with steps queued one ahead (a generation loop's rate).
    decode_pipelined_s: float = float("nan")
    # A free generation of as many tokens (None when not asked for or the arm cannot).
    generation: GenerationRun | None = None

    @property
    def decode_median_s(self) -> float:
        return statistics.median(self.decode_step_s)


COMPILE_ENV = "OMNIA_COMPILE"
TOP_K = 8


def top_logits(row: mx.array, k: int = TOP_K) -> dict[int, float]:
    """The k highest logits of one row, by token id."""
    values = np.array(row.astype(mx.float32), dtype=np.float32)
    ids = np.argpartition(-values, k)[:k]
    return {int(i): float(values[i]) for i in ids}


def omnia_arm(
    path: str, *, dtype: str, quantize: tuple[int, int] | None, reference: bool,
    eager: bool = False, chained: bool = True, kv_bits: int | None = None,
) -> Arm:
    """The engine through its public API; `reference` binds the core implementations, `eager`
    decodes without the compiled step (OMNIA_COMPILE=0, read when a sequence starts),
    `chained=False` binds no chained launch (OMNIA_CHAINED_KERNELS=0: each declaration of a pair
    runs its own launch), `kv_bits` a quantized KV cache (Model.quantize_kv_cache)."""
    before = {name: os.environ.get(name) for name in (FORCE_REFERENCE_ENV, CHAINED_ENV)}
    os.environ[FORCE_REFERENCE_ENV] = "1" if reference else "0"  # read once, at binding
    os.environ[CHAINED_ENV] = "1" if chained else "0"
    try:
        q = None if quantize is None else {"bits": quantize[0], "group_size": quantize[1]}
        model = load(path, dtype=dtype, quantize=q)
        if kv_bits is not None:
            model.quantize_kv_cache(kv_bits)
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value

    def new_sequence() -> Feed:
        saved = os.environ.get(COMPILE_ENV)
        if eager:
            os.environ[COMPILE_ENV] = "0"
        try:
            decoding = model.decoding()
        finally:
            if eager:
                if saved is None:
                    del os.environ[COMPILE_ENV]
                else:
                    os.environ[COMPILE_ENV] = saved

        def feed(ids: Sequence[int]) -> tuple[mx.array, list[mx.array]]:
            if len(ids) > 1 and last_only:
                return decoding.feed(ids, last_only=True), decoding.state()
            return decoding.feed(ids), decoding.state()

        return feed

    # An older tree (`paired --ref`) may compute the head for every prompt row.
    last_only = "last_only" in inspect.signature(model.decoding().feed).parameters

    # An older tree (`paired --ref`) may predate nbytes/bindings.
    nbytes = cast(int, getattr(model, "nbytes", 0))
    step_bytes = cast(int, getattr(model, "decode_bytes", 0))
    bindings_of = getattr(model, "bindings", None)
    bindings = cast(dict[str, str], bindings_of()) if callable(bindings_of) else {}
    def generate(text: str, tokens: int, sampling: Sampling) -> GenerationRun:
        options = GenerationOptions(
            max_tokens=tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop=[sampling.stop],
        )
        clock = Clock()
        finish, prompt_tokens = "?", 0
        for piece in model.stream(text, options):
            clock.arrived(len(piece.token_ids), len(piece.text))
            if piece.finish_reason is not None:
                finish = piece.finish_reason
                prompt_tokens = piece.usage.prompt_tokens if piece.usage else 0
        return clock.run(prompt_tokens, finish)

    name = ("omnia-reference" if reference else "omnia-eager" if eager
            else "omnia-unchained" if not chained else "omnia")
    if kv_bits is not None:
        name += f"-kv{kv_bits}"
    return Arm(name, nbytes, new_sequence, bindings, step_bytes, generate, dtype)


class Clock:
    """Times a generation from the call: when its first text arrived and when its last did."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.tokens = self.first_tokens = self.chars = 0

    def arrived(self, tokens: int, chars: int) -> None:
        now = time.perf_counter()
        self.tokens += tokens
        self.chars += chars
        if self.first is None and tokens:
            self.first, self.first_tokens = now, self.tokens
        self.last = now

    def run(self, prompt_tokens: int, finish: str) -> GenerationRun:
        first = self.first if self.first is not None else self.last
        return GenerationRun(first - self.start, self.last - first, self.tokens,
                             self.first_tokens, prompt_tokens, self.chars, finish)


def mlx_lm_importable() -> str | None:
    """mlx-lm's version when it can be imported, else None."""
    try:
        module = importlib.import_module("mlx_lm")
    except ImportError:
        return None
    return str(getattr(module, "__version__", "?"))


def mlx_lm_model(path: str, *, dtype: str, quantize: tuple[int, int] | None) -> tuple[Any, int]:
    """mlx-lm's model of the directory, cast and quantized as the engine does it: cast the
    floats to `dtype`, then affine-quantize every Linear/Embedding whose input dimension is a
    multiple of the group size. Returns the model (evaluated) and its weights' bytes."""
    utils: Any = importlib.import_module("mlx_lm.utils")
    nn: Any = importlib.import_module("mlx.nn")
    tree_flatten: Any = importlib.import_module("mlx.utils").tree_flatten
    model, _ = utils.load_model(Path(path))
    model.set_dtype(getattr(mx, dtype))
    if quantize is not None:
        bits, group_size = quantize

        def quantizable(_: str, module: Any) -> bool:
            return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=quantizable)
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    evaluate([a for _, a in params])
    return model, sum(a.nbytes for _, a in params)


def mlx_lm_arm(path: str, *, dtype: str, quantize: tuple[int, int] | None) -> Arm:
    """mlx-lm on the same directory (`mlx_lm_model`): fresh caches and stream_generate."""
    utils: Any = importlib.import_module("mlx_lm.utils")
    cache_module: Any = importlib.import_module("mlx_lm.models.cache")
    model, nbytes = mlx_lm_model(path, dtype=dtype, quantize=quantize)

    def new_sequence() -> Feed:
        cache = cache_module.make_prompt_cache(model)

        def states() -> list[mx.array]:
            return [cast(mx.array, a) for c in cache for a in c.state]

        def feed(ids: Sequence[int]) -> tuple[mx.array, list[mx.array]]:
            # a prompt as mlx-lm's generate_step prefills it: all but the last id in chunks of
            # MLX_LM_PREFILL_STEP, each chunk's cache evaluated, then the last id alone
            ids = list(ids)
            while len(ids) > 1:
                n = min(MLX_LM_PREFILL_STEP, len(ids) - 1)
                model(mx.array([ids[:n]], dtype=mx.int32), cache=cache)
                evaluate(states())
                ids = ids[n:]
            logits = cast(mx.array, model(mx.array([ids], dtype=mx.int32), cache=cache))
            return logits[0], states()

        return feed

    generate_module: Any = importlib.import_module("mlx_lm.generate")
    sample_utils: Any = importlib.import_module("mlx_lm.sample_utils")
    tokenizer = utils.load_tokenizer(Path(path))

    def generate(text: str, tokens: int, sampling: Sampling) -> GenerationRun:
        # mlx-lm's own loop (stream_generate: its sampler, its streaming detokenizer); the stop
        # string is matched here on the text so far, as mlx_lm.server does on its side.
        sampler = sample_utils.make_sampler(
            temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
        mx.random.seed(sampling.seed)
        clock = Clock()
        finish, prompt_tokens, tail = "length", 0, ""
        for response in generate_module.stream_generate(
            model, tokenizer, text, max_tokens=tokens, sampler=sampler
        ):
            piece = cast(str, response.text)
            clock.arrived(1, len(piece))
            prompt_tokens = int(response.prompt_tokens)
            tail = (tail + piece)[-(len(sampling.stop) + len(piece)):]
            if sampling.stop in tail:
                finish = "stop"
                break
            if response.finish_reason is not None:
                finish = str(response.finish_reason)
        return clock.run(prompt_tokens, finish)

    return Arm("mlx-lm", nbytes, new_sequence, generate=generate, dtype=dtype)


def run_once(
    arm: Arm, prompt: Sequence[int], generate: Sequence[int],
    text: str | None = None, sampling: Sampling | None = None,
) -> RunResult:
    """Prefill the prompt, then teacher-force `generate` twice on fresh sequences:
    - step by step, each step evaluated and waited on (its whole latency: host work to build and
      dispatch the step, then the GPU's), recording each step's argmax and top logits;
    - pipelined, each step queued before the previous one is waited on, as a generation loop
      runs (Model.generate, mlx-lm's generate_step): the host builds step t+1 while the GPU runs
      step t, so this is the rate a generation sustains.
    Only logits are evaluated per step (the caches are their inputs, so they are written then);
    no cache array is held across a step, so in-place cache updates stay in place."""
    feed = arm.new_sequence()
    start = time.perf_counter()
    logits, state = feed(prompt)
    evaluate(logits, *state)
    prefill_s = time.perf_counter() - start
    del state
    last = np.array(logits[-1].astype(mx.float32), dtype=np.float32)
    steps: list[float] = []
    argmax: list[int] = []
    tops: list[dict[int, float]] = []
    for token in generate:
        start = time.perf_counter()
        logits, state = feed([token])
        del state
        evaluate(logits)
        steps.append(time.perf_counter() - start)
        argmax.append(cast(int, mx.argmax(logits[-1]).item()))  # untimed
        tops.append(top_logits(logits[-1]))
    del feed, logits
    rate = pipelined(arm, prompt, generate)
    free = None
    if text is not None and arm.generate is not None:
        free = arm.generate(text, len(generate), sampling or Sampling())
    return RunResult(prefill_s, steps, last, argmax, tops, rate, free)


def pipelined(arm: Arm, prompt: Sequence[int], generate: Sequence[int]) -> float:
    """Seconds per decode step with steps queued one ahead (see run_once)."""
    feed = arm.new_sequence()
    logits, state = feed(prompt)
    evaluate(logits, *state)
    del state
    start = time.perf_counter()
    pending: mx.array | None = None
    for token in generate:
        logits, state = feed([token])
        del state
        row = logits[-1]
        mx.async_eval(row)  # pyright: ignore[reportUnknownMemberType]  # stub: *args untyped
        if pending is not None:
            evaluate(pending)
        pending = row
    if pending is not None:
        evaluate(pending)
    return (time.perf_counter() - start) / max(len(generate), 1)


def warm_up(
    arm: Arm, prompt: Sequence[int], generate: Sequence[int],
    text: str | None = None, sampling: Sampling | None = None,
) -> None:
    """One untimed pass of the same prompt length (kernels compiled, buffers allocated)."""
    run_once(arm, prompt, generate[: min(len(generate), 4)], text, sampling)


def run_arm_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One arm in this process, for `paired`: load, warm up, `runs` timed runs."""
    quantize = spec.get("quantize")
    q = None if quantize is None else (int(quantize[0]), int(quantize[1]))
    arm = omnia_arm(
        str(spec["path"]), dtype=str(spec["dtype"]), quantize=q, reference=bool(spec["reference"])
    )
    prompt, generate = list(spec["prompt"]), list(spec["generate"])
    text = cast(str | None, spec.get("text"))
    sampling = Sampling(**spec["sampling"]) if spec.get("sampling") else None
    warm_up(arm, prompt, generate, text, sampling)
    runs = [run_once(arm, prompt, generate, text, sampling)
            for _ in range(int(spec.get("runs", 1)))]
    return {
        "mlx_omnia_file": mlx_omnia.__file__,
        "weight_bytes": arm.weight_bytes,
        "step_bytes": arm.step_bytes,
        "runs": [
            {
                "prefill_s": r.prefill_s,
                "decode_step_s": r.decode_step_s,
                "decode_pipelined_s": r.decode_pipelined_s,
                "decode_argmax": r.decode_argmax,
                "prefill_last_argmax": int(np.argmax(r.prefill_last_logits)),
                "generation": None if r.generation is None else r.generation.to_json(),
            }
            for r in runs
        ],
    }


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -P measure.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = cast(dict[str, Any], json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(run_arm_spec(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
