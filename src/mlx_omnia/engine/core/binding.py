"""Binding layer declarations to implementations (design rule 4).

A declaration states *what* arithmetic runs (a matmul with these weight formats, an RMS norm with
this epsilon, ...). After loading, when weight formats are final, each declaration binds the
first registered kernel whose predicate accepts every declared property, else its core MLX
implementation, which always applies and is the numerical reference. Kernels register themselves
here (`register`), by declaration type; a declaration never imports a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import mlx.nn as nn

D = TypeVar("D", bound="Declaration")
M = TypeVar("M")


@dataclass(frozen=True)
class Declared(Generic[M]):
    """What a declaration names without owning it (the norm before a projection, the parts of a
    chain): kept out of the module tree, where an nn.Module attribute would be adopted, so the
    parameters stay where the checkpoint puts them."""

    value: M


class Kernel(Generic[D]):
    """One specialized implementation of a declaration type.

    `fits` accepts a declaration only where the kernel computes exactly what it declares,
    whatever the backend; `applies` adds what the running process must offer (the backend, a
    switch); `build` makes the bound call. `chained`: it runs two or more declared operations in
    one launch (docs/kernels.md); binding can leave such kernels out, the parts then running on
    their own bindings."""

    name: str = ""
    declaration: type[Any] = object
    chained: bool = False
    # a kernel that fits every declaration of its type (the core's own arithmetic, laid out for
    # a backend): tried after the specialized kernels of the type, whatever the import order
    general: bool = False

    def fits(self, decl: D) -> bool:
        raise NotImplementedError

    def applies(self, decl: D) -> bool:
        raise NotImplementedError

    def build(self, decl: D) -> Callable[..., Any]:
        raise NotImplementedError


_KERNELS: dict[type[Any], list[Kernel[Any]]] = {}


def register(kernel: Kernel[Any]) -> None:
    """Make `kernel` a candidate for its declaration type. A type's kernels are tried in the
    order they registered: a kernel registers before a more general one of the same type."""
    known = _KERNELS.setdefault(kernel.declaration, [])
    if all(k is not kernel for k in known):
        known.append(kernel)


def kernels_for(declaration: type[Any]) -> tuple[Kernel[Any], ...]:
    """The kernels registered for exactly this declaration type, in trial order: in the order
    they registered, general kernels last."""
    return tuple(sorted(_KERNELS.get(declaration, ()), key=lambda k: k.general))


class Declaration(nn.Module):
    """Base of every layer declaration: an nn.Module whose forward is bound after loading."""

    # The attributes holding the bound calls (a traced forward records them: core/fusion.py),
    # and how many values one call returns (a tuple when more than one).
    entries: tuple[str, ...] = ("_bound",)
    results: int = 1

    def __init__(self) -> None:
        super().__init__()
        self.binding = "core"

    def traced_call(self, entry: str) -> Callable[..., Any]:
        """The public call whose bound implementation `entry` holds."""
        return self

    def declared(self) -> Iterator[Declaration]:
        """The declarations this one names (its `Declared` attributes), in the order it named
        them."""
        for value in vars(self).values():
            if isinstance(value, Declared):
                named = cast(Declared[object], value).value
                items = cast(tuple[object, ...], named) if isinstance(named, tuple) else (named,)
                yield from (item for item in items if isinstance(item, Declaration))

    def reference(self) -> Callable[..., Any]:
        """The core MLX implementation of this declaration."""
        raise NotImplementedError

    def bind(self, *, force_reference: bool = False, chained: bool = True) -> str:
        """Bind the first registered kernel that applies (`chained=False` skips chained ones),
        else the core implementation; returns the bound implementation's name."""
        chosen: Callable[..., Any] | None = None
        name = "core"
        if not force_reference:
            for kernel in kernels_for(type(self)):
                if (chained or not kernel.chained) and kernel.applies(self):
                    chosen, name = kernel.build(self), kernel.name
                    break
        self._bound = chosen if chosen is not None else self.reference()
        self.binding = name
        return name
