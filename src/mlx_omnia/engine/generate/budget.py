"""A reasoning budget: once an answer has reasoned for its budget of tokens, the template's end
marker is forced, and the answer goes on after it."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlx_omnia.engine.generate.sampling import Sampler


class ReasoningBudget:
    """Wraps a sequence's sampler: counts the tokens of its reasoning block (opened by
    `begin_id` as the first token, or already open when `inside`) and, at `budget`, samples
    `end_ids` in place of the model's choice. Needs each token before the next is sampled
    (`follow`). The inner sampler still runs every step, so its state and log-probabilities
    stay in step with the tokens (a forced token's logprob entry is the model's choice's)."""

    def __init__(
        self, sampler: Sampler, budget: int, begin_id: int | None, end_ids: Sequence[int],
        inside: bool,
    ) -> None:
        self.sampler = sampler
        self.budget = budget
        self.begin_id = begin_id
        self.end_ids = list(end_ids)
        self.inside = inside
        self.closed = False
        self.count = 0
        self.recent: list[int] = []
        self.forced: list[int] = list(self.end_ids) if inside and budget == 0 else []

    def follow(self, token: int) -> None:
        self.sampler.follow(token)
        if self.closed:
            return
        if not self.inside:  # the first token opens the block, or there is none
            self.inside = token == self.begin_id
            self.closed = not self.inside
            if self.inside and self.budget == 0:
                self.forced = list(self.end_ids)
            return
        self.recent = [*self.recent, token][-len(self.end_ids) :]
        if self.recent == self.end_ids:
            self.inside, self.closed = False, True
            return
        if not self.forced:
            self.count += 1
            if self.count >= self.budget:
                self.forced = list(self.end_ids)

    def __call__(self, logits: mx.array) -> mx.array:
        token = self.sampler(logits)
        if self.forced:
            return mx.array(self.forced.pop(0), dtype=mx.int32)
        return token
