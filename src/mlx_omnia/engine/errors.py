"""Typed errors a user can hit. Every message says what to do about it."""

from __future__ import annotations


class OmniaError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(OmniaError):
    """The model reference names nothing that exists locally or on the hub."""


class CheckpointError(OmniaError):
    """A checkpoint's files are missing, corrupt, truncated or inconsistent."""


class UnsupportedModelError(OmniaError):
    """The checkpoint's model_type or a variant of it is not implemented."""


class TokenizerError(OmniaError):
    """The tokenizer or chat template cannot be built or used."""


class ChatTemplateError(TokenizerError):
    """The checkpoint has no chat template, or rendering it failed."""


class ContextLengthError(OmniaError):
    """The prompt (plus requested tokens) does not fit the model's context."""


class InvalidOptionsError(OmniaError, ValueError):
    """A generation option is out of range or unsupported by this model's signature.

    `option` names the GenerationOptions field at fault (None when no one field is) and `reason`
    is the message without that name, so a server can say it with the name its client used."""

    def __init__(self, message: str, *, option: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.option = option
        self.reason = message if reason is None else reason


class ConstraintError(OmniaError):
    """Generation could not keep to its Constraint: llguidance's matcher failed mid-answer or left
    no token to choose (a grammar that must go on where the model's vocabulary cannot)."""


class DownloadError(OmniaError):
    """A hub download failed (network, interrupted transfer, missing revision)."""
