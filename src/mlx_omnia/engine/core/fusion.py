"""Which neighbouring declarations run as one launch: decided here, from each family's table.

A family writes its forward as the arithmetic reads and puts its table on it:

    FUSED = Fusions(NORM_INTO_PROJECTIONS, PROJECTIONS_INTO_ATTENTION, RESIDUAL_INTO_PROJECTION,
                    PROJECTION_INTO_PROJECTIONS)

    class Qwen3DecoderLayer(nn.Module):
        @FUSED
        def __call__(self, x, cache):
            h = x + self.self_attn(self.input_layernorm(x), cache)
            return h + self.mlp(self.post_attention_layernorm(h))

When the model is bound, each such forward is traced once (core/trace.py: which declarations
it calls on what, and the `+`, `*` and activations between them). Every chain the table names
becomes the declaration that runs it (Projections, ProjectAttend, ChainedProjections, ...), and
those bind like any other: a kernel where one computes the chain, else their parts on their own
bindings. Where at least one binds a kernel, the forward runs as that plan; everywhere else
(no table, the CPU, the reference kernels) it runs as written. The plan computes what the
forward computes, with the same ops in the same order where no kernel binds.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import mlx.nn as nn

from mlx_omnia.engine.core.activations import GATES
from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    ChainedProjections,
    Embedding,
    Linear,
    ProjectAttend,
    Projections,
    RmsNorm,
)
from mlx_omnia.engine.core.moe import DownCombine, GateUp, ProjectRoute, Route, RouteExperts
from mlx_omnia.engine.core.mxcompat import named_modules
from mlx_omnia.engine.core.trace import Graph, Op, Traced, Untraceable

F = TypeVar("F", bound=Callable[..., Any])
D = TypeVar("D", bound=Declaration)

# The chains a table may name, in the order the binding pass looks for them; each runs as one
# declaration (CHAINS), which binds a kernel where one computes it.
NORM_INTO_PROJECTIONS = "norm+projections"
"""An RMS norm read by projections of it alone (q/k/v; gate/up and their activation; a head; a
router): Projections(norm=)."""
NORM_INTO_EXPERTS = "norm+experts"
"""An RMS norm the experts' gate/up reads: GateUp(norm=)."""
ROUTER_INTO_ROUTE = "router+route"
"""A router's projection read only by the routing: Route(router=)."""
EXPERTS_CHAIN = "experts"
"""The experts' gate/up read only by their down projections: DownCombine(gate_up=)."""
RESIDUAL_INTO_PROJECTION = "residual"
"""A projection's output added to a residual: Linear(residual=), DownCombine(residual=)."""
PROJECTIONS_INTO_ATTENTION = "projections+attention"
"""The q/k/v projections read only by the attention: ProjectAttend."""
PROJECTION_INTO_PROJECTIONS = "projection+projections"
"""A projection with its residual, then the projections of the sum: ChainedProjections."""
PROJECTION_INTO_ROUTE = "projection+route"
"""A projection with its residual, then the routing of the sum: ProjectRoute."""
ROUTE_INTO_EXPERTS = "route+experts"
"""ProjectRoute, then the experts of its sum with the sum as their residual: RouteExperts."""

KINDS = (NORM_INTO_PROJECTIONS, NORM_INTO_EXPERTS, ROUTER_INTO_ROUTE, EXPERTS_CHAIN,
         RESIDUAL_INTO_PROJECTION, PROJECTIONS_INTO_ATTENTION, PROJECTION_INTO_PROJECTIONS,
         PROJECTION_INTO_ROUTE, ROUTE_INTO_EXPERTS)

# The declaration each kind of chain runs as.
CHAINS: dict[str, type[Declaration]] = {
    NORM_INTO_PROJECTIONS: Projections,
    NORM_INTO_EXPERTS: GateUp,
    ROUTER_INTO_ROUTE: Route,
    EXPERTS_CHAIN: DownCombine,
    RESIDUAL_INTO_PROJECTION: Linear,
    PROJECTIONS_INTO_ATTENTION: ProjectAttend,
    PROJECTION_INTO_PROJECTIONS: ChainedProjections,
    PROJECTION_INTO_ROUTE: ProjectRoute,
    ROUTE_INTO_EXPERTS: RouteExperts,
}

_FUSED = "__omnia_fusions__"  # on a decorated forward: (its Fusions, the forward as written)
_PLANS = "_omnia_plans"  # on a module: {forward name: its Plan}


class Fusions:
    """A family's table: the chains the binding pass may run as one declaration in the forwards
    it decorates. Decorating changes nothing until the model is bound."""

    def __init__(self, *kinds: str) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fusions {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.kinds = frozenset(kinds)

    def __call__(self, forward: F) -> F:
        name = forward.__name__

        @functools.wraps(forward)
        def run(module: nn.Module, *args: Any) -> Any:
            plans: dict[str, Plan] | None = module.__dict__.get(_PLANS)
            plan = plans.get(name) if plans is not None else None
            if plan is not None and plan.active:
                return plan(*args)
            return forward(module, *args)

        setattr(run, _FUSED, (self, forward))
        return cast(F, run)


class Plan:
    """A traced forward with its chains as declarations: calls them in the forward's order."""

    def __init__(self, graph: Graph, inputs: list[Traced], result: Result,
                 composites: list[Declaration], views: dict[int, Declaration]) -> None:
        self.ops = graph.ops
        self.inputs = inputs
        self.result = result
        self.composites = composites
        self.views = views  # a chain's copy of the family's declaration (GateUp after its norm)
        self.active = False
        self._compile()

    def __call__(self, *args: Any) -> Any:
        return self._run(*args)

    def _compile(self) -> None:
        """The plan as one Python function, its steps straight-line code over local names (a
        prefill builds the graph eagerly, once a chunk: interpreting a step list cost ~10 us a
        layer of host time there). Inputs are `a[i]`, values `v<slot>`, constants `k<j>`."""
        slot = {id(t): i for i, t in enumerate(self.inputs)}
        for op in self.ops:
            for t in op.outputs:
                slot[id(t)] = len(slot)
        n_inputs = len(self.inputs)
        names: dict[str, Any] = {}

        def ref(v: object) -> str:
            if isinstance(v, Traced):
                i = slot[id(v)]
                return f"a[{i}]" if i < n_inputs else f"v{i}"
            name = f"k{len(names)}"
            names[name] = v
            return name

        lines = ["def run(*a):"]
        for j, op in enumerate(self.ops):
            names[f"c{j}"] = op.call
            args = [ref(x) for x in op.args] + [f"{k}={ref(x)}" for k, x in op.kwargs.items()]
            outs = [f"v{slot[id(t)]}" for t in op.outputs]
            lines.append(f"    r = c{j}({', '.join(args)})")
            if len(outs) == 1:  # a call may hand back its one output as a 1-tuple
                lines.append(f"    {outs[0]} = r[0] if type(r) is tuple else r")
            else:
                lines.append(f"    {', '.join(outs)}, = r")
        result = [ref(v) for v in self.result.values]
        lines.append(f"    return {result[0]}" if self.result.single
                     else f"    return ({', '.join(result)},)")
        exec("\n".join(lines), names)  # our own generated code, no input text
        self._run: Callable[..., Any] = names["run"]

    def declarations(self) -> Iterator[Declaration]:
        """The chain declarations, in binding order: each op's, then the chains it names."""
        made = {id(c) for c in self.composites}

        def walk(decl: Declaration) -> Iterator[Declaration]:
            yield decl
            for part in reversed(list(decl.declared())):
                if id(part) in made:
                    yield from walk(part)

        for op in self.ops:
            if isinstance(op.decl, Declaration) and id(op.decl) in made:
                yield from walk(op.decl)

    def members(self, decl: Declaration) -> Iterator[Declaration]:
        """The family's declarations a chain runs, in the order it names them."""
        made = {id(c) for c in self.composites}
        if id(decl) in self.views:
            yield self.views[id(decl)]
        for part in decl.declared():
            if id(part) in made:
                yield from self.members(part)
            else:
                yield part


@functools.cache
def fused_forwards(cls: type) -> tuple[tuple[str, Fusions, Callable[..., Any]], ...]:
    """(name, table, forward as written) of each decorated forward of a module class."""
    found: dict[str, tuple[str, Fusions, Callable[..., Any]]] = {}
    for base in cls.__mro__:
        for name, attr in vars(base).items():
            if name not in found and hasattr(attr, _FUSED):
                table, forward = getattr(attr, _FUSED)
                found[name] = (name, table, forward)
    return tuple(found.values())


def make_plans(module: nn.Module) -> dict[str, Plan]:
    """Trace `module`'s decorated forwards and make their plans (inactive: the binding pass
    turns on those where a chain binds a kernel); kept on the module."""
    made = {name: plan(module, forward, table)
            for name, table, forward in fused_forwards(type(module))}
    if made or _PLANS in module.__dict__:
        module.__dict__[_PLANS] = made
    return made


def plans_of(module: nn.Module) -> dict[str, Plan]:
    """The plans `make_plans` left on `module`."""
    return cast(dict[str, Plan], module.__dict__.get(_PLANS, {}))


def plan(module: nn.Module, forward: Callable[..., Any], table: Fusions) -> Plan:
    graph, inputs, result = trace(module, forward)
    return Rewrite(graph, result, table.kinds).plan(inputs)


@dataclass(frozen=True)
class Result:
    """What a traced forward returned: one value, or a tuple of them."""

    values: tuple[object, ...]
    single: bool

    @classmethod
    def of(cls, returned: object) -> Result:
        if isinstance(returned, tuple):
            return cls(tuple(cast(tuple[object, ...], returned)), single=False)
        return cls((returned,), single=True)


def trace(module: nn.Module, forward: Callable[..., Any]) -> tuple[Graph, list[Traced], Result]:
    """Run `forward` on stand-ins with every declaration of `module` recording its calls."""
    graph = Graph()
    params = list(inspect.signature(forward).parameters.values())[1:]
    inputs = [graph.value() for _ in params]
    swapped: list[tuple[Declaration, str, Any]] = []
    for _, decl in named_modules(module):
        if isinstance(decl, Declaration):
            for entry in decl.entries:
                swapped.append((decl, entry, decl.__dict__[entry]))
                decl.__dict__[entry] = _recorder(graph, decl, entry)
    try:
        result = forward(module, *inputs)
    except (Untraceable, TypeError, ValueError, AttributeError) as e:
        raise Untraceable(
            f"{type(module).__name__}.{forward.__name__} cannot be traced for its fusions ({e}): "
            "between declarations a fused forward may only add, multiply and call activations"
        ) from e
    finally:
        for decl, entry, bound in swapped:
            decl.__dict__[entry] = bound
    return graph, inputs, Result.of(result)


def _recorder(graph: Graph, decl: Declaration, entry: str) -> Callable[..., Any]:
    call = decl.traced_call(entry)

    def record(*args: Any, **kwargs: Any) -> Any:
        outputs = graph.record(call, args, kwargs, decl.results, decl).outputs
        return outputs[0] if len(outputs) == 1 else outputs

    return record


class Rewrite:
    """Turns the chains a table names into ops of their declarations, in a traced forward."""

    def __init__(self, graph: Graph, result: Result, kinds: frozenset[str]) -> None:
        self.graph = graph
        self.result = result
        self.kinds = kinds
        self.composites: list[Declaration] = []
        self.views: dict[int, Declaration] = {}

    # -- the graph ------------------------------------------------------------------------
    @property
    def ops(self) -> list[Op]:
        return self.graph.ops

    def results(self) -> tuple[object, ...]:
        return self.result.values

    def users(self, value: Traced) -> list[Op]:
        return [op for op in self.ops if any(a is value for a in op.inputs())]

    def only_user(self, value: Traced, op: Op) -> bool:
        """`op` is the only reader of `value`, which the forward does not return."""
        return all(u is op for u in self.users(value)) and all(r is not value for r in self.results())

    def producer(self, value: Any) -> Op | None:
        if not isinstance(value, Traced):
            return None
        return next((op for op in self.ops if any(o is value for o in op.outputs)), None)

    def replace(self, absorbed: list[Op], op: Op, at: Op) -> None:
        """`op` in place of `at`; the other absorbed ops go."""
        self.ops[self.ops.index(at)] = op
        for gone in absorbed:
            if gone is not at and gone in self.ops:
                self.ops.remove(gone)

    def made(self, decl: D) -> D:
        self.composites.append(decl)
        return decl

    def drop_unused(self) -> None:
        """Drop the arithmetic and norms nothing reads any more (a norm a chain took in); other
        calls stay, as written (an attention writes its cache)."""
        changed = True
        while changed:
            changed = False
            for op in list(self.ops):
                if op.decl is not None and type(op.decl) is not RmsNorm:
                    continue
                if all(not self.users(o) and all(r is not o for r in self.results()) for o in op.outputs):
                    self.ops.remove(op)
                    changed = True

    # -- the chains -----------------------------------------------------------------------
    def plan(self, inputs: list[Traced]) -> Plan:
        passes: dict[str, Callable[[], None]] = {
            NORM_INTO_PROJECTIONS: self.norm_into_projections,
            NORM_INTO_EXPERTS: self.norm_into_experts,
            ROUTER_INTO_ROUTE: self.router_into_route,
            EXPERTS_CHAIN: self.experts_chain,
            RESIDUAL_INTO_PROJECTION: self.residual_into_projection,
            PROJECTIONS_INTO_ATTENTION: self.projections_into_attention,
            PROJECTION_INTO_PROJECTIONS: self.projection_into_projections,
            PROJECTION_INTO_ROUTE: self.projection_into_route,
            ROUTE_INTO_EXPERTS: self.route_into_experts,
        }
        for kind in KINDS:
            if kind in self.kinds:
                passes[kind]()
                self.drop_unused()
        return Plan(self.graph, inputs, self.result, self.composites, self.views)

    def calls(self, kind: type[Any]) -> list[Op]:
        """Ops calling a declaration of exactly type `kind` (its own `__call__`)."""
        return [op for op in self.ops if type(op.decl) is kind and op.call is op.decl]

    def projection(self, op: Op, value: Traced) -> bool:
        """`op` projects `value` alone: a Linear without residual, or an Embedding's head."""
        if op.args != (value,) or op.kwargs:
            return False
        return (type(op.decl) is Linear and op.call is op.decl) or (
            type(op.decl) is Embedding and op.call is not op.decl)

    def norm_into_projections(self) -> None:
        for norm in self.calls(RmsNorm):
            n = norm.outputs[0]
            readers = [u for u in self.users(n) if self.projection(u, n)]
            if not readers:
                continue
            gated = self.gated_pair(readers)
            if gated is not None:
                gate, up, act, mul = gated
                if len(readers) != 2:
                    continue
                decl = self.made(Projections([gate.decl, up.decl], norm=norm.decl, gate=GATES[act.call]))
                op = Op(decl, (norm.args[0],), {}, mul.outputs, decl)
                self.replace([gate, up, act, mul], op, gate)
                continue
            decl = self.made(Projections([u.decl for u in readers], norm=norm.decl))
            op = Op(decl, (norm.args[0],), {}, tuple(u.outputs[0] for u in readers), decl)
            self.replace(readers, op, readers[0])

    def gated_pair(self, readers: list[Op]) -> tuple[Op, Op, Op, Op] | None:
        """(gate, up, activation, product) where two projections combine as act(gate) * up."""
        for gate in readers:
            users = self.users(gate.outputs[0])
            if (len(users) != 1 or users[0].decl is not None or users[0].call not in GATES
                    or not self.only_user(gate.outputs[0], users[0])):
                continue
            act = users[0]
            muls = self.users(act.outputs[0])
            if (len(muls) != 1 or muls[0].call is not operator.mul
                    or not self.only_user(act.outputs[0], muls[0])):
                continue
            mul = muls[0]
            other = mul.args[1] if mul.args[0] is act.outputs[0] else mul.args[0]
            up = self.producer(other)
            if up is not None and up in readers and up is not gate and self.only_user(up.outputs[0], mul):
                return gate, up, act, mul
        return None

    def norm_into_experts(self) -> None:
        for op in self.calls(GateUp):
            norm = self.producer(op.args[0])
            if norm is None or type(norm.decl) is not RmsNorm or norm.call is not norm.decl:
                continue
            gate_up = cast(GateUp, op.decl)
            decl = self.made(gate_up.after_norm(norm.decl))
            self.views[id(decl)] = gate_up
            self.replace([op], Op(decl, (norm.args[0], *op.args[1:]), dict(op.kwargs), op.outputs, decl), op)

    def router_into_route(self) -> None:
        for op in self.calls(Route):
            router = self.producer(op.args[0])
            if (router is None or type(router.decl) is not Projections or len(router.outputs) != 1
                    or not self.only_user(router.outputs[0], op)):
                continue
            decl = self.made(cast(Route, op.decl).with_router(router.decl))
            self.replace([router, op], Op(decl, router.args, {}, op.outputs, decl), op)

    def experts_chain(self) -> None:
        for op in self.calls(DownCombine):
            up = self.producer(op.args[0])
            if (up is None or type(up.decl) is not GateUp or up.call is not up.decl
                    or up.args[1] is not op.args[1] or not self.only_user(up.outputs[0], op)):
                continue
            down = cast(DownCombine, op.decl)
            decl = self.made(down.after(up.decl))
            self.views[id(decl)] = down
            args = (up.args[0], *op.args[1:])
            self.replace([up, op], Op(decl, args, dict(op.kwargs), op.outputs, decl), op)

    def residual_into_projection(self) -> None:
        for add in [op for op in self.ops if op.call is operator.add]:
            for side in (1, 0):
                proj = self.producer(add.args[side])
                if proj is None or not self.only_user(add.args[side], add):
                    continue
                plain_linear = type(proj.decl) is Linear and len(proj.args) == 1
                plain_down = type(proj.decl) is DownCombine and len(proj.args) == 3
                if proj.call is not proj.decl or proj.kwargs or not (plain_linear or plain_down):
                    continue
                merged = Op(proj.call, (*proj.args, add.args[1 - side]), {}, add.outputs, proj.decl)
                self.replace([proj, add], merged, add)
                break

    def projections_into_attention(self) -> None:
        for op in self.calls(AttentionStep):
            qkv = self.producer(op.args[0])
            if (qkv is None or type(qkv.decl) is not Projections or len(qkv.outputs) != 3
                    or tuple(op.args[:3]) != qkv.outputs
                    or not all(self.only_user(o, op) for o in qkv.outputs)):
                continue
            decl = self.made(ProjectAttend(qkv.decl, cast(AttentionStep, op.decl)))
            self.replace([qkv, op], Op(decl, (qkv.args[0], op.args[3]), {}, op.outputs, decl), op)

    def residual_projection(self, op: Op) -> bool:
        return type(op.decl) is Linear and op.call is op.decl and len(op.args) == 2

    def projection_into_projections(self) -> None:
        for proj in [op for op in self.ops if self.residual_projection(op)]:
            h = proj.outputs[0]
            then = next((u for u in self.users(h) if type(u.decl) is Projections and u.args == (h,)), None)
            if then is None:
                continue
            decl = self.made(ChainedProjections(cast(Linear, proj.decl), cast(Projections, then.decl)))
            self.replace([proj, then], Op(decl, proj.args, {}, (h, *then.outputs), decl), proj)

    def projection_into_route(self) -> None:
        for proj in [op for op in self.ops if self.residual_projection(op)]:
            h = proj.outputs[0]
            route = next((u for u in self.users(h) if type(u.decl) is Route and u.args == (h,)
                          and u.decl.router is not None), None)
            if route is None:
                continue
            decl = self.made(ProjectRoute(cast(Linear, proj.decl), cast(Route, route.decl)))
            self.replace([proj, route], Op(decl, proj.args, {}, (h, *route.outputs), decl), proj)

    def route_into_experts(self) -> None:
        for pair in self.calls(ProjectRoute):
            h, weights, ids = pair.outputs
            experts = next((u for u in self.users(h) if type(u.decl) is DownCombine), None)
            if (experts is None or tuple(experts.args) != (h, ids, weights, h)
                    or cast(DownCombine, experts.decl).gate_up is None
                    or not all(self.only_user(v, experts) for v in (h, weights, ids))):
                continue
            decl = self.made(RouteExperts(cast(ProjectRoute, pair.decl), cast(DownCombine, experts.decl)))
            self.replace([pair, experts], Op(decl, pair.args, {}, experts.outputs, decl), pair)

