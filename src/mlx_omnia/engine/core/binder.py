"""The binding pass over a loaded model: the chains each family's table names become
declarations (core/fusion.py), then every declaration binds an implementation.

Importing this module registers the kernels (each kernel package registers its own with the
binding layer); nothing below it imports them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.nn as nn

from mlx_omnia.engine.core import fusion
from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.kernels import (
    attention_step,
    dequantized_matmul,
    grouped_experts,
    moe,
    qmv,
    scratch_scope,
)
from mlx_omnia.engine.core.mxcompat import named_modules

# imported for their registrations
KERNEL_PACKAGES = (qmv, attention_step, moe, grouped_experts, dequantized_matmul)

FORCE_REFERENCE_ENV = "OMNIA_REFERENCE_KERNELS"
CHAINED_ENV = "OMNIA_CHAINED_KERNELS"


def declarations(model: nn.Module) -> Iterator[tuple[str, Declaration]]:
    """Every declaration of `model`, by module path, in binding order: a module's chains (named
    `path/Type(member, ...)`) before the declarations below it."""
    modules = named_modules(model)
    paths = {id(m): p for p, m in modules}
    for path, module in modules:
        for plan in fusion.plans_of(module).values():
            for decl in plan.declarations():
                names = (paths[id(m)].removeprefix(f"{path}.") for m in plan.members(decl))
                chain = f"{type(decl).__name__}({', '.join(names)})"
                yield (f"{path}/{chain}" if path else chain), decl
        if isinstance(module, Declaration):
            yield path, module


def bind_layers(
    model: nn.Module, *, force_reference: bool | None = None, chained: bool | None = None
) -> dict[str, str]:
    """Make the chains each family's table names, then bind every declaration in `model`;
    returns {module path: implementation name}.

    `force_reference` (or OMNIA_REFERENCE_KERNELS=1) binds the core implementations everywhere,
    for A/B runs against the reference. `chained=False` (or OMNIA_CHAINED_KERNELS=0) leaves out
    the implementations that run two declarations in one launch, for A/B runs against separate
    launches. A forward runs as its plan of chains where at least one of them binds a kernel,
    else as written."""
    if force_reference is None:
        force_reference = os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0")
    if chained is None:
        chained = os.environ.get(CHAINED_ENV, "") != "0"
    for _, module in named_modules(model):
        fusion.make_plans(module)
    with scratch_scope():  # the model's kernels share one launch scratch
        bound = {
            path: decl.bind(force_reference=force_reference, chained=chained)
            for path, decl in declarations(model)
        }
    for _, module in named_modules(model):
        for plan in fusion.plans_of(module).values():
            plan.active = any(c.binding != "core" for c in plan.composites)
    return bound


def bindings(model: nn.Module) -> dict[str, str]:
    """The implementation bound to each declaration, by module path."""
    return {path: decl.binding for path, decl in declarations(model)}
