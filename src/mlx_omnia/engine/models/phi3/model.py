"""Phi3ForCausalLM, module for module as the checkpoint names it.

The checkpoint fuses projections: `qkv_proj` holds q | k | v rows, `gate_up_proj` gate | up
rows; rope may cover only the first `rotary_dims` features of a head (partial_rotary_factor)
and may be LongRoPE, whose periods switch from the short to the long factors once a sequence
passes original_max_position_embeddings. transformers' generate then recomputes the whole
prefix with the long factors (every layer's keys and hidden states change); so does this model:
its caches remember the ids fed while the sequence is short, and the call that crosses the
boundary reruns them. That needs the eager cache, so a longrope model opts out of compiled
decode."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm, Rope
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import LongRope, build_longrope, build_rope
from mlx_omnia.engine.models.phi3.config import Phi3Config


class Phi3Cache(KVCache):
    """The eager cache, plus (in layer 0's) the ids fed while the sequence fits in the short
    rope range: a longrope model reruns them when the sequence crosses it."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: mx.array | None = None

    def reset(self) -> None:
        self.keys = self.values = None
        self.offset = 0


class Phi3Attention(nn.Module):
    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.n_heads * self.head_dim
        kv_size = self.n_kv_heads * self.head_dim
        self.splits = (q_size, q_size + kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size)
        self.o_proj = Linear(q_size, cfg.hidden_size)
        self.rope: Rope | LongRope
        if cfg.rope["rope_type"] == "longrope":
            self.rope = build_longrope(cfg.rotary_dims, cfg.rope)
        else:
            self.rope = build_rope(cfg.rotary_dims, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            window=cfg.sliding_window,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        qkv = self.qkv_proj(x)
        q_end, k_end = self.splits
        q = reshape(qkv[..., :q_end], b, length, self.n_heads, -1).swapaxes(1, 2)
        k = reshape(qkv[..., q_end:k_end], b, length, self.n_kv_heads, -1).swapaxes(1, 2)
        v = reshape(qkv[..., k_end:], b, length, self.n_kv_heads, -1).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Phi3MLP(nn.Module):
    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up_proj(x)
        n = self.intermediate_size
        return self.down_proj(silu(gate_up[..., :n]) * gate_up[..., n:])


class Phi3DecoderLayer(nn.Module):
    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.self_attn = Phi3Attention(cfg)
        self.mlp = Phi3MLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(nn.Module):
    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Phi3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Phi3ForCausalLM(nn.Module):
    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Phi3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.longrope = cfg.rope["rope_type"] == "longrope"
        self.original_max = int(cfg.rope["original_max_position_embeddings"])
        # Crossing the longrope boundary reruns the prefix: that needs the eager cache.
        self.compile_decode = not self.longrope

    def _logits(
        self, ids: mx.array, cache: list[KVCache] | None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        if not self.longrope or cache is None or not isinstance(cache[0], Phi3Cache):
            return self._logits(ids, cache, last_only)
        first = cache[0]
        start, length = first.offset, ids.shape[1]
        if start > self.original_max:  # long already: nothing to remember or rerun
            return self._logits(ids, cache, last_only)
        seen = ids if first.ids is None else mx.concatenate([first.ids, ids], axis=1)
        if start > 0 and start + length > self.original_max:
            # The sequence crosses into the long range: rerun it all with the long periods.
            for c in cache:
                if isinstance(c, Phi3Cache):
                    c.reset()
            first.ids = None
            return self._logits(seen, cache, last_only)[:, -length:]
        first.ids = seen
        return self._logits(ids, cache, last_only)

    def make_cache(self) -> list[KVCache]:
        return [Phi3Cache() for _ in self.model.layers]
