"""GraniteMoeHybridConfig from config.json: transformers 5 (`layer_types` of linear_attention /
full_attention, `rope_parameters`, `time_step_limit`) and transformers 4 / the hub's (`layer_types`
of mamba / attention, or its alias `layers_block_type`; top-level `rope_theta` / `rope_scaling`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

MAMBA, ATTENTION = "mamba", "attention"
# each spelling of a layer kind: transformers 4's and the hub's, transformers 5's
KIND_NAMES = {
    "mamba": MAMBA, "linear_attention": MAMBA,
    "attention": ATTENTION, "full_attention": ATTENTION,
}
# the rope kinds whose tables transformers and core.rope compute alike for this family
ROPE_TYPES = ("default", "linear", "llama3")


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"granitemoehybrid: {what}")


def _float(value: Any) -> float:
    """A number as config.json holds it: transformers 5 writes infinity as
    {"__float__": "Infinity"}, older configs as the bare token Infinity."""
    if isinstance(value, Mapping):
        return float(cast(Mapping[str, Any], value)["__float__"])
    return float(value)


def _multiplier(config: Mapping[str, Any], name: str) -> float:
    """One of Granite's scalars (default 1); null is refused, transformers cannot run it."""
    value = config.get(name, 1.0)
    if value is None:
        raise _refuse(f"{name} null is not supported (a number, default 1.0)")
    return float(value)


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's kind, "mamba" or "attention": `layer_types` (or its alias
    `layers_block_type`) in either spelling, every layer Mamba when neither is given (as both
    transformers 4 and 5 default)."""
    given = config.get("layer_types", config.get("layers_block_type"))
    if given is None:
        return (MAMBA,) * layers
    names = tuple(str(k) for k in cast(Sequence[Any], given))
    if len(names) != layers:
        raise _refuse(f"layer_types names {len(names)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(names) - set(KIND_NAMES))
    if unknown:
        raise _refuse(f"layer_types {', '.join(unknown)} not supported "
                      f"({', '.join(KIND_NAMES)})")
    return tuple(KIND_NAMES[k] for k in names)


def _rope(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The attention's rope parameters, or None where it has none (position_embedding_type
    null or "nope": transformers builds a rotary embedding for "rope" only)."""
    kind = config.get("position_embedding_type")
    if kind in (None, "nope"):
        return None
    if kind != "rope":
        raise _refuse(f"position_embedding_type {kind!r} is not supported (rope, nope or null)")
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        raise _refuse(f"rope_type {rope['rope_type']!r} is not supported "
                      f"({', '.join(ROPE_TYPES)})")
    # the default table of this family rotates every feature whatever the factor says; the
    # scaled kinds would rotate a part, which core.rope's tables do not
    if rope["rope_type"] != "default" and float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse("partial_rotary_factor is not supported with scaled rope")
    return rope


@dataclass(frozen=True)
class GraniteMoeHybridConfig:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Granite's scalars: embeddings times embedding_multiplier, attention scores times
    # attention_multiplier (instead of 1/sqrt(head_dim)), each mixer's and MLP's output times
    # residual_multiplier before the residual add, logits divided by logits_scaling.
    embedding_multiplier: float
    attention_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope: Mapping[str, Any] | None
    # experts (none: num_local_experts 0, the shared MLP alone) and the shared MLP
    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    shared_intermediate_size: int
    # Mamba-2
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GraniteMoeHybridConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise _refuse(f"num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")

        inner = int(config.get("mamba_expand", 2)) * hidden
        mamba_heads = int(config.get("mamba_n_heads", 128))
        if inner % mamba_heads:
            raise _refuse(f"mamba_n_heads {mamba_heads} does not divide mamba_expand * "
                          f"hidden_size ({inner})")
        d_head = config.get("mamba_d_head", "auto")
        d_head = inner // mamba_heads if d_head == "auto" else int(d_head)
        if d_head * mamba_heads != inner:
            raise _refuse(f"mamba_d_head * mamba_n_heads ({d_head * mamba_heads}) != "
                          f"mamba_expand * hidden_size ({inner})")
        groups = int(config.get("mamba_n_groups", 1))
        if mamba_heads % groups:
            raise _refuse(f"mamba_n_heads {mamba_heads} is not a multiple of "
                          f"mamba_n_groups {groups}")
        limit = cast(Sequence[Any], config.get("time_step_limit") or (0.0, math.inf))
        if (_float(limit[0]), _float(limit[1])) != (0.0, math.inf):
            # the reference clamps the steps in its chunked prefill but not in its decode step,
            # so its prefill and its decode compute two models; released checkpoints do not clamp
            raise _refuse(f"time_step_limit {[_float(v) for v in limit]} is not supported "
                          "(only (0, inf): released checkpoints)")

        if config.get("num_local_experts", 8) is None:
            raise _refuse("num_local_experts null is not supported (a count; 0: no experts)")
        experts = int(config.get("num_local_experts", 8))
        top_k = int(config.get("num_experts_per_tok", 2))
        if experts < 0 or (experts and not 0 < top_k <= experts):
            raise _refuse(f"num_experts_per_tok {top_k} of num_local_experts {experts} is not "
                          "supported (1 to num_local_experts, or no experts)")
        shared = int(config.get("shared_intermediate_size", 1024))
        if shared <= 0:
            raise _refuse(f"shared_intermediate_size {shared} is not supported (every layer "
                          "has the shared MLP)")
        return cls(
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            num_hidden_layers=layers,
            layer_types=layer_types(config, layers),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            embedding_multiplier=_multiplier(config, "embedding_multiplier"),
            attention_multiplier=_multiplier(config, "attention_multiplier"),
            residual_multiplier=_multiplier(config, "residual_multiplier"),
            logits_scaling=_multiplier(config, "logits_scaling"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            attention_bias=bool(config.get("attention_bias", False)),
            rope=_rope(config),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            intermediate_size=int(config.get("intermediate_size", 11008)),
            shared_intermediate_size=shared,
            mamba_n_heads=mamba_heads,
            mamba_d_head=d_head,
            mamba_d_state=int(config.get("mamba_d_state", 256)),
            mamba_n_groups=groups,
            mamba_d_conv=int(config.get("mamba_d_conv", 4)),
            mamba_conv_bias=bool(config.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
        )
