"""GptOssForCausalLM, module for module as the checkpoint names it.

Attention with q/k/v/o biases and a learned sink logit per head (`sinks`: it joins every
softmax and takes probability mass without contributing a value), sliding-window (per
layer_types) or full; yarn rope. Every layer's MLP is sparse: a `router` with bias, the top-k
router logits softmaxed over themselves, and the selected experts' projections with biases and
gpt-oss's clamped SwiGLU, stacked as experts.gate_up_proj ([gate; up] rows) / experts.down_proj,
dense or MXFP4 as checkpoints ship them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.gpt_oss.config import GptOssConfig


class GptOssAttention(nn.Module):
    sinks: mx.array

    def __init__(self, cfg: GptOssConfig, layer_type: str) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.sinks = mx.zeros((self.n_heads,))
        self.rope = build_rope(self.head_dim, cfg.rope)
        window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, window=window
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = reshape(self.q_proj(x), b, length, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = reshape(self.k_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache, sinks=self.sinks)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class GptOssExperts(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = GateUp(
            n, hidden, inner, bias=True, activation="gpt_oss_swiglu",
            alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
        )
        self.down_proj = DownCombine(n, inner, hidden, bias=True)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class GptOssMLP(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.router = Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.route = Route(cfg.num_local_experts, cfg.num_experts_per_tok, order="topk_softmax")
        self.experts = GptOssExperts(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.router(x))
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_type: str) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_type)
        self.mlp = GptOssMLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [GptOssDecoderLayer(cfg, kind) for kind in cfg.layer_types]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class GptOssForCausalLM(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = GptOssModel(cfg)
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
