"""Turning logits into the next token: biases, penalties, temperature and truncations."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling settings (checkpoint defaults already applied)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None


class Sampler:
    """Stateful sampler for one sequence: it tracks token counts for the penalties and owns the
    random key, so a fixed seed reproduces a sequence exactly."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int]) -> None:
        self.p = params
        self.vocab_size = vocab_size
        self._bias: mx.array | None = None
        if params.logit_bias:
            bias = np.zeros((vocab_size,), np.float32)
            for token_id, value in params.logit_bias.items():
                bias[token_id] += value
            self._bias = mx.array(bias)
        # Repetition penalty (HF semantics) covers prompt and output; presence/frequency
        # penalties (OpenAI semantics) cover the output only.
        self._seen: mx.array | None = None
        if params.repetition_penalty != 1.0:
            seen = np.zeros((vocab_size,), np.bool_)
            seen[[t for t in prompt_ids if 0 <= t < vocab_size]] = True
            self._seen = mx.array(seen.tolist())
        self._ids = mx.arange(vocab_size)
        self._counts: mx.array | None = None
        if params.presence_penalty or params.frequency_penalty:
            self._counts = mx.zeros((vocab_size,), mx.float32)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self.p.temperature <= 0.0

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (any float dtype) -> token id, an int32 scalar array (lazy)."""
        x = logits.astype(mx.float32)[: self.vocab_size]
        if self._bias is not None:
            x = x + self._bias[: x.shape[0]]
        if self._seen is not None:
            rp = self.p.repetition_penalty
            penalized = mx.where(x < 0, x * rp, x / rp)
            x = mx.where(self._seen[: x.shape[0]], penalized, x)
        if self._counts is not None:
            counts = self._counts[: x.shape[0]]
            x = x - self.p.frequency_penalty * counts - self.p.presence_penalty * (counts > 0)
        token = self._greedy(x) if self.greedy else self._sample(x)
        self._observe(token)
        return token

    def _observe(self, token: mx.array) -> None:
        if self._seen is not None:
            self._seen = self._seen | (self._ids == token)
        if self._counts is not None:
            self._counts = self._counts + (self._ids == token)

    @staticmethod
    def _greedy(x: mx.array) -> mx.array:
        return mx.argmax(x, axis=-1).astype(mx.int32)

    def _sample(self, x: mx.array) -> mx.array:
        p = self.p
        x = x / p.temperature
        if p.top_k and 0 < p.top_k < x.shape[0]:
            kth = mx.sort(x)[-p.top_k]
            x = mx.where(x < kth, -mx.inf, x)
        if p.min_p > 0.0:
            probs = mx.softmax(x, axis=-1)
            x = mx.where(probs < p.min_p * probs.max(), -mx.inf, x)
        if p.top_p < 1.0:
            order = mx.argsort(-x)
            sorted_probs = mx.softmax(x[order], axis=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = mx.cumsum(sorted_probs) - sorted_probs
            kept_sorted = mx.where(before < p.top_p, x[order], mx.inf)
            x = mx.where(x >= kept_sorted.min(), x, -mx.inf)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(x, key=sub).astype(mx.int32)
