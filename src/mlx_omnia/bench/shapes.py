"""Named real model shapes, and random-weight checkpoints of them built on the spot.

The shapes are the public config.json values of the released checkpoints; only the weights are
random, which is all a speed measurement needs (every arm computes the same arithmetic)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_omnia.bench.measure import evaluate

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}
_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}

_QWEN3_MOE_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "rope_scaling": None,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-4B
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": {
        **_LLAMA_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-30B-A3B: every layer sparse (intermediate_size is unused, but the config has it)
    "qwen3-30b-a3b": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # allenai/OLMoE-1B-7B-0924: q_norm/k_norm over the whole projections, no qkv clipping
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "clip_qkv": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    # For tests: every dimension a multiple of 64, so 4-bit g64 quantizes every matrix; untied
    # so lm_head is its own matrix.
    "tiny": {
        **_QWEN3_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rope_theta": 1000000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "tiny-llama": {
        **_LLAMA_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    # For tests: a qwen3_moe of 4 experts, top 2 (multiples of 64 as `tiny`, router included).
    "tiny-moe": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}


@dataclass(frozen=True)
class Draw:
    """One random tensor drawn at once: `name` itself, or with `experts` > 0 the stack
    [experts, *dims] of the per-expert tensors `name.format(e)` (name holds `experts.{}.`)."""

    name: str
    dims: tuple[int, ...]
    experts: int = 0

    def names(self) -> list[str]:
        return [self.name.format(e) for e in range(self.experts)] if self.experts else [self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.experts, *self.dims) if self.experts else self.dims


def _sparse(config: dict[str, Any], layer: int) -> bool:
    """Whether `layer` has the sparse MLP (qwen3_moe's decoder_sparse_step and mlp_only_layers;
    every olmoe layer)."""
    if config["model_type"] == "olmoe":
        return True
    if config["model_type"] != "qwen3_moe" or not int(config.get("num_experts") or 0):
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def draws(config: dict[str, Any]) -> list[Draw]:
    """The tensors of a llama/qwen3/qwen3_moe/olmoe checkpoint of this config, in drawing order;
    experts as per-expert HF names (mlp.experts.<e>.{gate,up,down}_proj.weight)."""
    kind = config["model_type"]
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or 0)
    kv = kv or heads
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    out = [Draw("model.embed_tokens.weight", (vocab, hidden)), Draw("model.norm.weight", (hidden,))]
    if not config.get("tie_word_embeddings", False):
        out.append(Draw("lm_head.weight", (vocab, hidden)))
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        out += [
            Draw(f"{p}.input_layernorm.weight", (hidden,)),
            Draw(f"{p}.post_attention_layernorm.weight", (hidden,)),
            Draw(f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            Draw(f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden)),
            Draw(f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden)),
            Draw(f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ]
        if _sparse(config, i):
            experts = int(config["num_experts"])
            moe = int(config.get("moe_intermediate_size") or inter)
            out += [
                Draw(f"{p}.mlp.gate.weight", (experts, hidden)),
                Draw(p + ".mlp.experts.{}.gate_proj.weight", (moe, hidden), experts),
                Draw(p + ".mlp.experts.{}.up_proj.weight", (moe, hidden), experts),
                Draw(p + ".mlp.experts.{}.down_proj.weight", (hidden, moe), experts),
            ]
        else:
            out += [
                Draw(f"{p}.mlp.gate_proj.weight", (inter, hidden)),
                Draw(f"{p}.mlp.up_proj.weight", (inter, hidden)),
                Draw(f"{p}.mlp.down_proj.weight", (hidden, inter)),
            ]
        if kind in ("qwen3", "qwen3_moe"):
            out.append(Draw(f"{p}.self_attn.q_norm.weight", (head_dim,)))
            out.append(Draw(f"{p}.self_attn.k_norm.weight", (head_dim,)))
        elif kind == "olmoe":  # over the whole projections
            out.append(Draw(f"{p}.self_attn.q_norm.weight", (heads * head_dim,)))
            out.append(Draw(f"{p}.self_attn.k_norm.weight", (kv * head_dim,)))
    return out


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama/qwen3/qwen3_moe/olmoe checkpoint of this config, by its HF name."""
    return {name: d.dims for d in draws(config) for name in d.names()}


def _quantizable(d: Draw, group_size: int) -> bool:
    """What both arms quantize at load: every matrix (Linear, Embedding, expert stack) whose
    input dimension is a multiple of the group size; norms stay as they are."""
    return len(d.dims) == 2 and d.dims[-1] % group_size == 0


def checkpoint_bytes(
    shape: str, *, dtype: str, quantize: tuple[int, int] | None = None
) -> int:
    """The bytes of weights build_checkpoint writes for the named shape (on disk, ~exactly:
    safetensors headers aside)."""
    config = SHAPES[shape]
    item = DTYPES[dtype].size
    total = 0
    for d in draws(config):
        count = 1
        for n in d.shape:
            count *= n
        if quantize is not None and _quantizable(d, quantize[1]):
            bits, group_size = quantize
            total += count * bits // 8 + 2 * (count // group_size) * item
        else:
            total += count * item
    return total


class _ShardWriter:
    """Writes tensors into safetensors shards of about `shard_bytes` each; one shard is
    model.safetensors, more are model-0000k-of-0000n.safetensors with an index (the hub's
    names, which this engine and mlx-lm both read)."""

    def __init__(self, path: Path, shard_bytes: int) -> None:
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}  # name -> shard number
        self.total = 0

    def add(self, name: str, tensor: mx.array) -> None:
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.weight_map[name] = len(self.files)
        self.total += tensor.nbytes

    def flush(self, *, force: bool = False) -> None:
        if not self.pending or (self.pending_bytes < self.shard_bytes and not force):
            return
        file = self.path / f"shard-{len(self.files):05d}.safetensors"
        mx.save_safetensors(  # pyright: ignore[reportUnknownMemberType]  # stub: return untyped
            str(file), self.pending, metadata={"format": "mlx"}
        )
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0
        mx.clear_cache()

    def close(self) -> None:
        self.flush(force=True)
        n = len(self.files)
        if n == 1:
            self.files[0].rename(self.path / "model.safetensors")
            return
        names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for file, name in zip(self.files, names, strict=True):
            file.rename(self.path / name)
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())},
        }
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_checkpoint(
    shape: str,
    path: Path,
    *,
    dtype: str,
    seed: int = 0,
    quantize: tuple[int, int] | None = None,
    shard_bytes: int = 4 * 2**30,
) -> Path:
    """Write a random-weight checkpoint of the named shape into `path` (config.json, the
    safetensors, tokenizer files): weights ~ normal(0, 0.02), norms 1, drawn with mx.random on
    the default device (seconds even for billions of weights on a GPU), experts a whole stack
    per projection and layer at once.

    Unquantized, experts are written per expert (mlp.experts.<e>.<proj>.weight, as hub
    checkpoints hold them). With `quantize` (bits, group_size) the matrices are affine-quantized
    before writing, in MLX's layout (weight/scales/biases and config "quantization"; experts
    stacked as mlx-community's mlp.switch_mlp.<proj>), so a 30B MoE takes ~17 GB, not ~61 GB;
    both the engine and mlx-lm load that as it is."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)} (or pass a path)")
    config = dict(SHAPES[shape]) | {"torch_dtype": dtype}
    if quantize is not None:
        config["quantization"] = {"group_size": quantize[1], "bits": quantize[0]}
    want = DTYPES[dtype]
    path.mkdir(parents=True, exist_ok=True)
    need = checkpoint_bytes(shape, dtype=dtype, quantize=quantize)
    free = shutil.disk_usage(path).free
    if need > free:
        raise SystemExit(
            f"a random {shape} checkpoint at {dtype} takes {need / 1e9:,.1f} GB but {path} has "
            f"{free / 1e9:,.1f} GB free: pass --workdir on a larger disk, or write it quantized "
            "(--quantize 4 --prequantize)"
        )
    plan = draws(config)
    keys = mx.random.split(mx.random.key(seed), len(plan))
    writer = _ShardWriter(path, shard_bytes)
    for i, d in enumerate(plan):
        if len(d.dims) == 1:
            w = mx.ones(d.shape, dtype=want)
        else:
            w = mx.random.normal(d.shape, dtype=want, scale=0.02, key=keys[i])
        if quantize is not None and _quantizable(d, quantize[1]):
            bits, group_size = quantize
            wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
            base = d.name.replace(".experts.{}.", ".switch_mlp.").removesuffix(".weight")
            parts = {f"{base}.weight": wq, f"{base}.scales": scales, f"{base}.biases": biases}
        elif d.experts:
            parts = {name: w[e] for e, name in enumerate(d.names())}
        else:
            parts = {d.name: w}
        evaluate(list(parts.values()))
        for name, tensor in parts.items():
            writer.add(name, tensor)
        del w, parts
        writer.flush()
    writer.close()
    mx.clear_cache()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, int(config["vocab_size"]))
    return path
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's and SmolLM2-Instruct's templates write a plain conversation (no tools, no
# thinking), so `agent-replay` can send a Chat to the engine and messages to mlx_lm.server.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in of each of the 256 bytes, as byte-level BPE vocabularies write
    them: printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def bpe_vocabulary(vocab_size: int, seed: int = 0) -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of `vocab_size` ids, the last ones the special tokens: the
    256 bytes, then words (a space and a letter run) grown a letter at a time from random
    earlier words; no training needed. A word's merges are its prefixes' chain and no two
    letters merge alone, so a decoded word encodes back to the same token."""
    normal = vocab_size - len(SPECIAL_TOKENS)
    symbols = byte_symbols()
    if normal < len(symbols) + 26:
        raise ValueError(f"a byte-level vocabulary needs at least {len(symbols) + 29} ids")
    letters = [symbols[b] for b in b"etaoinshrdlucmfwypvbgkqjxz"]
    space = symbols[ord(" ")]
    rng = np.random.default_rng(seed)
    tokens, seen = list(symbols), set(symbols)
    merges: list[tuple[str, str]] = []
    words: list[str] = []
    for letter in letters:
        if len(tokens) < normal:
            merges.append((space, letter))
            tokens.append(space + letter)
            seen.add(space + letter)
            words.append(space + letter)
    while len(tokens) < normal:
        a = words[int(rng.integers(len(words)))]
        b = letters[int(rng.integers(len(letters)))]
        if a + b in seen:
            continue
        tokens.append(a + b)
        seen.add(a + b)
        words.append(a + b)
        merges.append((a, b))
    return tokens + list(SPECIAL_TOKENS), merges


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer covering every id of the model (no hub, no training), so a
    free generation from random weights detokenizes as a real model's would; ChatML as its
    chat template."""
    tokens, merges = bpe_vocabulary(vocab_size)
    first_special = len(tokens) - len(SPECIAL_TOKENS)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": first_special + i, "content": w, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i, w in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {w: i for i, w in enumerate(tokens)},
                  "merges": [[a, b] for a, b in merges]},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }))
