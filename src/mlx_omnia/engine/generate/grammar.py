"""A Constraint's state for one sequence: llguidance's matcher and the tokens it allows next."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from mlx_omnia.engine.errors import ConstraintError
from mlx_omnia.engine.types import Constraint


class GrammarMask:
    """Which tokens may come next under a constraint, as llguidance's bitmask: int32 words, token
    i allowed when bit i % 32 of word i // 32 is set. `follow` moves it past each token the
    sequence takes; the mask is computed on the host, while the device runs the next forward."""

    def __init__(self, constraint: Constraint, tokenizer: LLTokenizer) -> None:
        self._matcher = LLMatcher(tokenizer, constraint.grammar(), log_level=0)
        if self._matcher.is_error():  # Signature.check refuses such a grammar first
            constraint.check(tokenizer)  # raises InvalidOptionsError with llguidance's reason
            raise self._failed("the grammar did not compile")
        self._ends = frozenset(tokenizer.eos_tokens)
        self.words = np.zeros(((tokenizer.vocab_size + 31) // 32,), np.int32)
        self._compute()

    def allowed(self) -> mx.array:
        """The current mask, int32 [ceil(V / 32)] (a copy: `words` is overwritten next step)."""
        return mx.array(self.words)

    def follow(self, token: int) -> None:
        """Take `token` (one the mask allowed) and compute the mask after it; an end token ends
        the sequence, so nothing follows it."""
        if not self._matcher.consume_token(token):
            raise self._failed(f"token {token} was refused")
        if token not in self._ends:
            self._compute()

    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        if self._matcher.is_error():
            raise self._failed("the mask could not be computed")
        if not self.words.any():
            raise self._failed("no token of this vocabulary may come next (no end token?)")

    def _failed(self, what: str) -> ConstraintError:
        error = self._matcher.get_error()
        return ConstraintError(
            f"generation stopped: the constraint could not be followed ({what}"
            f"{': ' + error.splitlines()[0] if error else ''}); check the grammar against "
            "this model's tokenizer"
        )
