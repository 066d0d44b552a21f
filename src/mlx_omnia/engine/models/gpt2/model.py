"""Gpt2LMHeadModel, module for module as the checkpoint names it (transformer.h.N.attn.c_attn
...).

Learned absolute position embeddings (wpe) added to the token embeddings, no rope; pre-norm
blocks with LayerNorms (bias); one fused q/k/v projection (c_attn) over all heads; a two-matrix
GELU(tanh) MLP; biases on every projection; the head tied to wte. Positions come from the cache
offset."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import gelu_tanh
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, LayerNorm, Linear
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.models.gpt2.config import Gpt2Config


class Gpt2Attention(nn.Module):
    def __init__(self, cfg: Gpt2Config, layer: int) -> None:
        super().__init__()
        self.n_heads = cfg.n_head
        self.head_dim = cfg.head_dim
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=True)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=True)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_heads, head_dim=self.head_dim,
            scale=cfg.attention_scale(layer),
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        qkv = reshape(self.c_attn(x), b, length, 3, self.n_heads, self.head_dim)
        q = qkv[:, :, 0].swapaxes(1, 2)
        k = qkv[:, :, 1].swapaxes(1, 2)
        v = qkv[:, :, 2].swapaxes(1, 2)
        out = self.attention.attend(q, k, v, cache)
        return self.c_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Gpt2MLP(nn.Module):
    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, cfg.n_inner, bias=True)
        self.c_proj = Linear(cfg.n_inner, cfg.n_embd, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Gpt2Block(nn.Module):
    def __init__(self, cfg: Gpt2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.attn = Gpt2Attention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.mlp = Gpt2MLP(cfg)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.attn(self.ln_1(x), cache)
        return h + self.mlp(self.ln_2(h))


class Gpt2Model(nn.Module):
    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd)
        self.h = [Gpt2Block(cfg, i) for i in range(cfg.n_layer)]
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        offset = cache[0].offset if cache is not None else 0
        if isinstance(offset, mx.array) and offset.ndim == 1:  # a batch: each row's own
            offset = offset[:, None]
        positions = mx.arange(ids.shape[-1], dtype=mx.int32) + offset
        h = self.wte(ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            h = block(h, cache[i] if cache is not None else None)
        return self.ln_f(h)


class Gpt2LMHeadModel(nn.Module):
    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = Gpt2Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.transformer(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.transformer.wte.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.transformer.h]
