"""A forward traced once with stand-in values: which declarations it calls on what, and the
arithmetic between them (`+`, `*`, activations), in the order it runs.

The binding pass traces a family's fused forwards with these values (core/fusion.py) to find
the chains its table names. Only what a forward between declarations may do is recorded: a
stand-in read for anything else (a shape, an attribute, an MLX function) stops the trace.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


class Untraceable(TypeError):
    """The forward did something with a traced value that is not recorded."""


class Traced:
    """A stand-in for an array in a traced forward."""

    __slots__ = ("graph",)

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def __add__(self, other: object) -> Traced:
        return self.graph.result(operator.add, (self, other))

    def __radd__(self, other: object) -> Traced:
        return self.graph.result(operator.add, (other, self))

    def __mul__(self, other: object) -> Traced:
        return self.graph.result(operator.mul, (self, other))

    def __rmul__(self, other: object) -> Traced:
        return self.graph.result(operator.mul, (other, self))

    def __getattr__(self, name: str) -> Any:
        raise Untraceable(f"a traced forward read .{name} of a value")


@dataclass(eq=False)
class Op:
    """One step of a traced forward: `call(*args, **kwargs)` gives `outputs`. `decl` is the
    declaration `call` belongs to (None for arithmetic)."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict[str, Any])
    outputs: tuple[Traced, ...] = ()
    decl: Any = None

    def inputs(self) -> list[Any]:
        return [*self.args, *self.kwargs.values()]


class Graph:
    """The ops of one traced forward, in the order it ran them."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def value(self) -> Traced:
        return Traced(self)

    def record(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               results: int, decl: Any = None) -> Op:
        op = Op(call, args, kwargs, tuple(Traced(self) for _ in range(results)), decl)
        self.ops.append(op)
        return op

    def result(self, call: Callable[..., Any], args: tuple[Any, ...]) -> Traced:
        return self.record(call, args, {}, 1).outputs[0]


def traceable(fn: F) -> F:
    """`fn` (a function of arrays a forward calls between declarations, an activation) as a
    recorded step when it is given a traced value, and as itself otherwise."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        for arg in args:
            if isinstance(arg, Traced):
                return arg.graph.result(fn, args)
        return fn(*args)

    return cast(F, run)
