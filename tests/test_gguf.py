"""GGUF loading: the embedded default, tiny llama GGUFs written here from a known HF-layout state
dict (F32/F16/Q8_0, tied and untied), and bad files that must fail with typed, helpful errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file

from mlx_omnia import (
    Chat,
    CheckpointError,
    Model,
    TokenizerError,
    UnsupportedModelError,
    load,
)
from mlx_omnia.engine.loading.resolve import default_model_path
from tests.fixtures.tiny import write_tiny_llama
from tests.fixtures.tokenizer import CHATML

Q = gguf.GGMLQuantizationType

# Our own reading of llama.cpp's tensor names (independent of the engine's table).
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

IDS = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300]


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{kind}"


def interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, rotate-half order
    (x0..x{d/2-1}, y0..y{d/2-1}) becomes interleaved pairs (x0, y0, x1, y1, ...)."""
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return w.reshape(n_heads, head_dim, -1)[:, order].reshape(w.shape)


def rounded(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The float32 values a tensor stored as `qtype` holds (1-D tensors stay F32 in GGUF)."""
    if w.ndim == 1 or qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize(w, qtype), qtype).astype(np.float32)


def tokenizer_metadata(hf_dir: Path) -> dict[str, Any]:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {a["content"] for a in data["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokens": tokens,
        "types": [3 if t in special else 1 for t in tokens],
        "merges": merges,
        "eos": vocab["<|im_end|>"],
        "pad": vocab["<|endoftext|>"],
    }


def write_llama_gguf(
    path: Path,
    hf_dir: Path,
    *,
    qtype: Q = Q.F32,
    arch: str = "llama",
    permute: bool = True,
    drop: tuple[str, ...] = (),
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    edit_metadata: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Write the HF-layout checkpoint in `hf_dir` as a llama.cpp-style GGUF file."""
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    tok = tokenizer_metadata(hf_dir)
    meta: dict[str, Any] = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "head_count": config["num_attention_heads"],
        "head_count_kv": config["num_key_value_heads"],
        "rms_eps": config["rms_norm_eps"],
        "rope_base": config["rope_theta"],
        "tokenizer_model": "gpt2",
        "pre": "gpt2",
    }
    if edit_metadata is not None:
        edit_metadata(meta)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    if "block_count" in meta:
        w.add_block_count(meta["block_count"])
    w.add_context_length(meta["context_length"])
    w.add_embedding_length(meta["embedding_length"])
    w.add_feed_forward_length(meta["feed_forward_length"])
    w.add_head_count(meta["head_count"])
    w.add_head_count_kv(meta["head_count_kv"])
    w.add_layer_norm_rms_eps(meta["rms_eps"])
    w.add_rope_freq_base(meta["rope_base"])
    w.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    w.add_tokenizer_model(meta["tokenizer_model"])
    w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(tok["eos"])
    w.add_pad_token_id(tok["pad"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, value in weights.items():
        if name in drop:
            continue
        value = value.astype(np.float32)
        if permute and name.endswith("self_attn.q_proj.weight"):
            value = interleave_rope_rows(value, config["num_attention_heads"])
        elif permute and name.endswith("self_attn.k_proj.weight"):
            value = interleave_rope_rows(value, config["num_key_value_heads"])
        if value.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), value)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(value, qtype), raw_dtype=qtype)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model: Model, ids: list[int] = IDS) -> np.ndarray:
    return np.array(model.logits(ids))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-hf"), seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf", tiny_dir)


# -- the embedded default ---------------------------------------------------------------------


def test_default_model_is_found(smollm2: Model) -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert smollm2.name == "smollm2-135m-instruct"
    assert smollm2.source == str(path)
    assert smollm2.model_type == "llama"
    assert smollm2.signature.inputs == frozenset({"text"})
    assert smollm2.signature.outputs == frozenset({"text"})
    assert smollm2.signature.context_length == 8192


def test_default_model_by_name(smollm2: Model) -> None:
    named = load("smollm2-135m-instruct")
    assert named.source == smollm2.source
    assert named.signature == smollm2.signature
    assert named.config == smollm2.config
    ids = named.encode(Chat(({"role": "user", "content": "Hi"},)))
    np.testing.assert_array_equal(logits(named, ids), logits(smollm2, ids))


# -- tiny GGUFs written from a known HF-layout state dict -------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_gguf_matches_hf_layout(tmp_path: Path, tied: bool) -> None:
    """Same float32 weights through both doors give the same logits: proves the names, the
    config read from metadata and the q/k row un-permutation (including GQA's k heads)."""
    hf_dir = write_tiny_llama(tmp_path / "hf", seed=1, tie_word_embeddings=tied)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf_dir)
    ours, ref = load(path), load(hf_dir)
    assert ours.config["tie_word_embeddings"] is tied
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert ours.config[key] == ref.config[key], key
    assert ours.signature.context_length == ref.signature.context_length == 256
    np.testing.assert_allclose(logits(ours), logits(ref), rtol=0, atol=1e-5)


def test_unpermuted_gguf_differs(tmp_path: Path, tiny_dir: Path) -> None:
    """Control: a file whose q/k rows were NOT interleaved loads to different logits, so the
    test above really depends on the un-permutation."""
    path = write_llama_gguf(tmp_path / "plain.gguf", tiny_dir, permute=False)
    diff = np.abs(logits(load(path)) - logits(load(tiny_dir)))
    assert diff[0].max() < 1e-5  # position 0: rope is the identity, the permutation cancels
    assert diff.max() > 1e-2


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_matches_rounded_weights(tmp_path: Path, qtype: Q) -> None:
    """F16/Q8_0/Q4_0/Q4_1 tensors load to exactly the values gguf-py dequantizes them to."""
    hf_dir = write_tiny_llama(tmp_path / "hf", seed=2)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf_dir, qtype=qtype)
    ref_dir = tmp_path / "ref"
    shutil.copytree(hf_dir, ref_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    save_file(
        {k: rounded(v, qtype) for k, v in weights.items()}, str(ref_dir / "model.safetensors")
    )
    ours = load(path)
    for _, module in ours.network.named_modules():
        assert "scales" not in module  # expanded to dense float32 on the CPU
    np.testing.assert_allclose(logits(ours), logits(load(ref_dir)), rtol=0, atol=1e-5)


def test_tiny_gguf_tokenizer_matches_hf_layout(tiny_gguf: Path, tiny_dir: Path) -> None:
    ours, ref = load(tiny_gguf), load(tiny_dir)
    for text in [
        "",
        "Hello, world!",
        "The capital of France is Paris.",
        "1234567890 3.14",
        "Café 東京 🙂",
        "  two  spaces\n\ttab",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.tokenizer.decode(ours.encode(text)) == ref.tokenizer.decode(ref.encode(text))
    chat = Chat(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}))
    assert ours.encode(chat) == ref.encode(chat)
    assert ours.tokenizer.eos_token_ids == ref.tokenizer.eos_token_ids == {2}
    assert ours.tokenizer.vocab_size == ref.tokenizer.vocab_size


# -- bad files ----------------------------------------------------------------------------------


def test_truncated_default_gguf(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    for size in (len(data) // 2, len(data) - 16, 4096, 100):
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="truncated") as info:
            load(path)
        assert str(path) in str(info.value)


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    with default_model_path().open("rb") as f:
        path.write_bytes(b"GGML" + f.read(1 << 16)[4:])
    with pytest.raises(CheckpointError, match=r"not a GGUF file.*bad magic"):
        load(path)
    path.write_text("<html>404 Not Found</html>")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
        load(path)


def test_known_family_without_gguf_support(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_llama_gguf(tmp_path / "qwen2.gguf", tiny_dir, arch="qwen2")
    with pytest.raises(UnsupportedModelError, match="GGUF files of architecture 'qwen2'"):
        load(path)


def test_unexpected_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 64), np.float32)}
    path = write_llama_gguf(tmp_path / "moe.gguf", tiny_dir, extra_tensors=extra)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        load(path)


def test_missing_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    drop = ("model.layers.1.mlp.down_proj.weight",)
    path = write_llama_gguf(tmp_path / "missing.gguf", tiny_dir, drop=drop)
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj"):
        load(path)


def test_metadata_disagrees_with_tensors(tmp_path: Path, tiny_dir: Path) -> None:
    def wrong(meta: dict[str, Any]) -> None:
        meta["feed_forward_length"] = 96

    path = write_llama_gguf(tmp_path / "wrong.gguf", tiny_dir, edit_metadata=wrong)
    with pytest.raises(CheckpointError, match="shape"):
        load(path)


def test_missing_metadata(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_llama_gguf(
        tmp_path / "nometa.gguf", tiny_dir, edit_metadata=lambda m: m.pop("block_count")
    )
    with pytest.raises(UnsupportedModelError, match=r"llama\.block_count"):
        load(path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer_model", "llama", "tokenizer model 'llama'"),
        ("pre", "no-such-pre", "pre-tokenization 'no-such-pre'"),
    ],
)
def test_unsupported_tokenizer(
    tmp_path: Path, tiny_dir: Path, key: str, value: str, message: str
) -> None:
    path = write_llama_gguf(
        tmp_path / "tok.gguf", tiny_dir, edit_metadata=lambda m: m.update({key: value})
    )
    with pytest.raises(TokenizerError, match=message):
        load(path)


def test_loaded_gguf_runs(tiny_gguf: Path) -> None:
    model = load(tiny_gguf)
    out = model.logits(IDS)
    assert out.dtype == mx.float32 and tuple(out.shape) == (len(IDS), 320)
