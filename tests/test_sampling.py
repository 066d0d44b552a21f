"""The sampler's truncations (top-k, min-p, top-p) against a plain numpy statement of them, the
frequencies it draws against the exact distribution, and the compiled sampling step against
itself across settings."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.generate.sampling import Sampler, SamplingParams, truncate


def kept_reference(x: np.ndarray, top_k: int, min_p: float, top_p: float) -> set[int]:
    """The tokens left in, stated directly: top-k by rank, min-p against the largest
    probability, top-p as the smallest prefix by decreasing probability reaching the mass."""
    keep = np.ones(x.shape[0], bool)
    if 0 < top_k < x.shape[0]:
        keep &= x >= np.sort(x)[-top_k]
    if min_p > 0:
        probs = np.exp(np.where(keep, x, -np.inf) - x[keep].max())
        probs /= probs.sum()
        keep &= probs >= min_p * probs.max()
    if top_p < 1:
        probs = np.exp(np.where(keep, x, -np.inf) - x[keep].max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass = np.cumsum(probs[order])
        n = int(np.searchsorted(mass, top_p - 1e-12)) + 1
        keep &= np.isin(np.arange(x.shape[0]), order[:n]) | (x >= x[order[n - 1]])
    return set(np.flatnonzero(keep).tolist())


@pytest.mark.parametrize(
    ("top_k", "min_p", "top_p"),
    [(0, 0.0, 1.0), (1, 0.0, 1.0), (20, 0.0, 1.0), (0, 0.0, 0.9), (0, 0.0, 0.3), (20, 0.0, 0.95),
     (50, 0.0, 0.5), (0, 0.05, 1.0), (40, 0.02, 0.8), (3, 0.0, 0.999)],
)
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_truncate_keeps_what_the_definitions_keep(
    top_k: int, min_p: float, top_p: float, scale: float
) -> None:
    rng = np.random.default_rng(int(scale * 10) + top_k)
    for vocab in (300, 5000):
        x = (rng.standard_normal(vocab) * scale).astype(np.float32)
        p = SamplingParams(temperature=1.0, top_k=top_k, min_p=min_p, top_p=top_p)
        got = np.array(truncate(mx.array(x), p))
        kept = set(np.flatnonzero(np.isfinite(got)).tolist())
        assert kept == kept_reference(x, top_k, min_p, top_p)
        np.testing.assert_array_equal(got[np.isfinite(got)], x[np.isfinite(got)])


def test_truncate_keeps_ties_at_the_kth_value() -> None:
    x = mx.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    got = np.array(truncate(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.99)))
    assert np.isfinite(got).tolist() == [True, False, True, True, True, False]


# 16 distinct logits 0.2 apart, shuffled. The settings below were chosen so that no truncation
# threshold falls within 1% (of probability or of the min-p ratio) of a token: float32 rounding
# cannot move a token across a cut.
LOGITS = np.array(
    [1.1, -0.7, 0.9, -0.5, 1.5, 0.7, 0.1, 0.5, -1.3, -0.9, 0.3, -0.3, -1.1, -0.1, 1.3, -1.5],
    np.float32,
)
DRAWS = 8000  # a draw a call of the compiled step: seconds for all the settings
CHUNK = 1000  # draws queued before one evaluation


def draw_counts(p: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    """How often the engine's Sampler (the compiled step generation runs) draws each token in `n`
    calls on the same logits."""
    sampler = Sampler(p, logits.shape[0], [])
    x = mx.array(logits)
    counts = np.zeros(logits.shape[0], np.int64)
    for _ in range(n // CHUNK):
        tokens = np.array(mx.stack([sampler(x) for _ in range(CHUNK)]))
        counts += np.bincount(tokens, minlength=logits.shape[0])
    return counts


def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): 1 minus the regularized lower gamma P(df/2, stat/2),
    summed from its series in log space (no overflow for a huge stat; scipy is no dependency).
    Matches mpmath.gammainc to ~1e-12 absolute."""
    a, x = df / 2, stat / 2
    if x <= 0:
        return 1.0
    log_term = a * math.log(x) - x - math.lgamma(a + 1)  # x^a e^-x / Gamma(a + 1)
    lower, n = 0.0, 0
    while True:
        lower += math.exp(log_term)
        n += 1
        log_term += math.log(x / (a + n))
        if n > x and log_term < -40:
            return max(0.0, 1.0 - lower)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.5),
        # Each of min-p and top-p cuts here, and would cut elsewhere on untempered logits, or
        # with top-p before min-p (transformers' order keeps token 6 too).
        SamplingParams(temperature=0.6, top_k=10, top_p=0.95, min_p=0.08),
    ],
    ids=["t0.7", "t1.5", "top_k", "top_p", "min_p", "combined"],
)
def test_draws_follow_the_tempered_truncated_softmax(p: SamplingParams) -> None:
    """The frequencies match softmax(logits / temperature) over what top-k, min-p and top-p (in
    that order, on the tempered logits) keep; nothing outside is ever drawn."""
    z = LOGITS.astype(np.float64) / p.temperature
    kept = sorted(kept_reference(z, p.top_k, p.min_p, p.top_p))
    weights = np.exp(z[kept] - z[kept].max())
    expected = np.zeros(z.shape[0])
    expected[kept] = weights / weights.sum()
    assert DRAWS * expected[kept].min() >= 5  # where the chi-square approximation holds
    counts = draw_counts(dataclasses.replace(p, seed=1234), LOGITS, DRAWS)
    assert counts[expected == 0].sum() == 0, counts
    want = DRAWS * expected[kept]
    stat = float((((counts[kept] - want) ** 2) / want).sum())
    # Seeded, so the same draws every run; 1e-6 leaves room for another MLX's random stream.
    assert chi_square_sf(stat, len(kept) - 1) > 1e-6, (counts.tolist(), want.round(1).tolist())


def test_sampled_tokens_stay_inside_the_truncation() -> None:
    rng = np.random.default_rng(3)
    logits = mx.array(rng.standard_normal(2000).astype(np.float32))
    p = SamplingParams(temperature=0.8, top_k=30, top_p=0.7, seed=11)
    allowed = set(np.flatnonzero(np.isfinite(np.array(truncate(logits / 0.8, p)))).tolist())
    sampler = Sampler(p, 2000, [])
    drawn = {int(sampler(logits).item()) for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_a_seed_replays_and_settings_share_a_compiled_step() -> None:
    rng = np.random.default_rng(4)
    rows = [mx.array(rng.standard_normal(1000).astype(np.float32)) for _ in range(20)]

    def draw(p: SamplingParams) -> list[int]:
        sampler = Sampler(p, 1000, [1, 2, 3])
        return [int(sampler(r).item()) for r in rows]

    base = SamplingParams(temperature=1.0, top_p=0.9, seed=5, repetition_penalty=1.2,
                          frequency_penalty=0.5, logit_bias={7: 2.0})
    assert draw(base) == draw(base)
    assert draw(base) != draw(SamplingParams(**{**base.__dict__, "seed": 6}))
    greedy = draw(SamplingParams())
    assert greedy == [int(np.argmax(np.array(r))) for r in rows]


def test_the_same_setting_samples_in_another_thread() -> None:
    """The server's engine thread and a caller's thread can sample with the same setting (a
    compiled step shared between them once failed on a lazy constant of the other thread)."""
    import threading

    rows = [mx.array(np.random.default_rng(i).standard_normal(500).astype(np.float32)) for i in range(5)]
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=3, repetition_penalty=1.1)

    def draw() -> list[int]:
        sampler = Sampler(p, 500, [4])
        return [int(sampler(r).item()) for r in rows]

    here = draw()
    there: list[list[int]] = []
    worker = threading.Thread(target=lambda: there.append(draw()))
    worker.start()
    worker.join()
    assert there == [here]
