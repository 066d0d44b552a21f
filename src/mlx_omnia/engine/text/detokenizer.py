"""Incremental detokenization: text grows token by token, in whole UTF-8 characters only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decodes a growing token list, yielding only text that later tokens cannot change.

    It re-decodes a short window (from `prefix` to the end) and compares it with the window's
    already-emitted text, as a byte-level or SentencePiece decoder may merge across tokens; text
    ending in a replacement character is held back until the character completes."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is already emitted

    def seed(self, context: Sequence[int]) -> None:
        """Tokens the text continues (a raw prompt's or a prefill's last ones), never emitted:
        the first tokens then decode as they read after that text. A decoder that strips the
        leading space of a text's first token (SentencePiece's Metaspace) would otherwise drop
        it from a continuation."""
        self._ids = list(context)
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token: int) -> str:
        self._ids.append(token)
        window = self._ids[self._prefix :]
        done = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(window)
        if len(full) > len(done) and not full.endswith(REPLACEMENT):
            new = full[len(done) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back, up to its last whole character: an answer cut inside a
        character (max_tokens, or an end token after part of one) stops before it rather than
        ending in U+FFFD. (A U+FFFD the model spelled out whole at the very end is dropped too:
        decoded text cannot tell it from a partial character's.)"""
        done = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(done) :].rstrip(REPLACEMENT)
