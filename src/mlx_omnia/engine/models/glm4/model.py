"""Glm4ForCausalLM, module for module as the checkpoint names it.

Differs from llama in: q/k/v biases (o_proj has none); rope on interleaved pairs (x0, x1),
(x2, x3), ... of only the first `partial_rotary_factor` of each head; the MLP's gate and up
projections fused in one gate_up_proj (gate first); RMS norms after attention and after the MLP
(post_self_attn_layernorm, post_mlp_layernorm) besides the two before them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.glm4.config import Glm4Config


class Glm4Attention(nn.Module):
    def __init__(self, cfg: Glm4Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.rope = build_rope(cfg.rotary_dims, cfg.rope, traditional=True)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = reshape(self.q_proj(x), b, length, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = reshape(self.k_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Glm4MLP(nn.Module):
    def __init__(self, cfg: Glm4Config) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up_proj(x)
        n = self.intermediate_size
        return self.down_proj(silu(gate_up[..., :n]) * gate_up[..., n:])


class Glm4DecoderLayer(nn.Module):
    def __init__(self, cfg: Glm4Config) -> None:
        super().__init__()
        self.self_attn = Glm4Attention(cfg)
        self.mlp = Glm4MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RmsNorm(cfg.hidden_size, eps)
        self.post_self_attn_layernorm = RmsNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, eps)
        self.post_mlp_layernorm = RmsNorm(cfg.hidden_size, eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Glm4Model(nn.Module):
    def __init__(self, cfg: Glm4Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Glm4DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Glm4ForCausalLM(nn.Module):
    def __init__(self, cfg: Glm4Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Glm4Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
