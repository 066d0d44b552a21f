"""The correctness gate: two arms computed the same model on the same ids, so their logits must
agree within a tolerance fixed per dtype and format (docs/benchmarks.md, "The gate")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlx_omnia.bench import measure

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


def checks_against(
    first: str, results: dict[str, list[measure.RunResult]], tolerance: float
) -> dict[str, dict[str, Any]]:
    """Each arm's first run against the first arm's, through the gate."""
    ref = results[first][0]
    return {
        name: gate(ref, runs[0], tolerance) for name, runs in results.items() if name != first
    }
