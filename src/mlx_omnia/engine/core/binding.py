"""Binding layer declarations to implementations (design rule 4).

A declaration states *what* arithmetic runs (a matmul with these weight formats, an RMS norm with
this epsilon, ...). After loading, when weight formats are final, `bind_layers` gives each
declaration the first implementation whose `applies` predicate accepts every declared property,
else the core MLX implementation, which always applies and is the numerical reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import mlx.nn as nn

from mlx_omnia.engine.core.mxcompat import named_modules

D = TypeVar("D", bound="Declaration")

FORCE_REFERENCE_ENV = "OMNIA_REFERENCE_KERNELS"
CHAINED_ENV = "OMNIA_CHAINED_KERNELS"


@dataclass(frozen=True)
class Implementation(Generic[D]):
    """One way to compute a declaration. `applies` must accept only what it computes exactly.
    `chained`: it runs two declared operations in one launch (docs/kernels.md); binding can
    leave such implementations out (`chained=False`), the pair then running as separate
    launches."""

    name: str
    applies: Callable[[D], bool]
    build: Callable[[D], Callable[..., Any]]
    chained: bool = False


class Declaration(nn.Module):
    """Base of every layer declaration: an nn.Module whose forward is bound after loading."""

    # Specialized implementations, most specific first; the core one is not listed here.
    implementations: tuple[Implementation[Any], ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.binding = "core"

    def reference(self) -> Callable[..., Any]:
        """The core MLX implementation of this declaration."""
        raise NotImplementedError

    def bind(self, *, force_reference: bool = False, chained: bool = True) -> str:
        chosen: Callable[..., Any] | None = None
        name = "core"
        if not force_reference:
            for impl in self.implementations:
                if (chained or not impl.chained) and impl.applies(self):
                    chosen, name = impl.build(self), impl.name
                    break
        self._bound = chosen if chosen is not None else self.reference()
        self.binding = name
        return name


def _declarations(model: nn.Module) -> Iterator[tuple[str, Declaration]]:
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
    from mlx_omnia.engine.core.kernels import scratch_scope

    with scratch_scope():  # the model's kernels share one launch scratch
        return {
            path: decl.bind(force_reference=force_reference, chained=chained)
            for path, decl in _declarations(model)
        }


def bindings(model: nn.Module) -> dict[str, str]:
    """The implementation bound to each declaration, by module path."""
    return {path: decl.binding for path, decl in _declarations(model)}
