"""The binding pass over a loaded model: every layer declaration binds an implementation.

Importing this module registers the kernels (each kernel package registers its own with the
binding layer); nothing below it imports them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.nn as nn

from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.kernels import attention_step, moe, qmv, scratch_scope
from mlx_omnia.engine.core.mxcompat import named_modules

KERNEL_PACKAGES = (qmv, attention_step, moe)  # imported for their registrations

FORCE_REFERENCE_ENV = "OMNIA_REFERENCE_KERNELS"
CHAINED_ENV = "OMNIA_CHAINED_KERNELS"


def declarations(model: nn.Module) -> Iterator[tuple[str, Declaration]]:
    """Every declaration of `model`, by module path."""
    for path, module in named_modules(model):
        if isinstance(module, Declaration):
            yield path, module


def bind_layers(
    model: nn.Module, *, force_reference: bool | None = None, chained: bool | None = None
) -> dict[str, str]:
    """Bind every declaration in `model`; returns {module path: implementation name}.

    `force_reference` (or OMNIA_REFERENCE_KERNELS=1) binds the core implementations everywhere,
    for A/B runs against the reference. `chained=False` (or OMNIA_CHAINED_KERNELS=0) leaves out
    the implementations that run two declarations in one launch, for A/B runs against separate
    launches."""
    if force_reference is None:
        force_reference = os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0")
    if chained is None:
        chained = os.environ.get(CHAINED_ENV, "") != "0"
    with scratch_scope():  # the model's kernels share one launch scratch
        return {
            path: decl.bind(force_reference=force_reference, chained=chained)
            for path, decl in declarations(model)
        }


def bindings(model: nn.Module) -> dict[str, str]:
    """The implementation bound to each declaration, by module path."""
    return {path: decl.binding for path, decl in declarations(model)}
