"""Model.decode_bytes, the bandwidth floor's numerator in omnia-bench: the weights one decode step
reads, counted from the loaded modules against what the config says."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.layers import Embedding
from mlx_omnia.engine.core.moe import ExpertLinear
from mlx_omnia.engine.core.mxcompat import flat_parameters, named_modules
from tests.fixtures import parity


def _bytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())


def _expected(model_dir: str, quantize: dict[str, int] | None = None) -> tuple[int, int]:
    """(decode_bytes, what the config says it should be)."""
    model = load(parity.checkpoint_dir(model_dir, "v4"), quantize=quantize)
    cfg = model.config
    k, n = cfg["num_experts_per_tok"], cfg.get("num_experts", cfg.get("num_local_experts"))
    modules = named_modules(model.network)
    experts = sum(_bytes(flat_parameters(m)) for _, m in modules if isinstance(m, ExpertLinear))
    (table,) = [m for _, m in modules if isinstance(m, Embedding)]
    assert experts > 0 and not cfg.get("tie_word_embeddings")
    unread = experts * (1 - k / n) + _bytes(flat_parameters(table)) * (1 - 1 / cfg["vocab_size"])
    return model.decode_bytes, int(model.nbytes - unread)


@pytest.mark.parametrize("variant", ["qwen3_moe-sparse", "gpt_oss-mxfp4", "qwen2_moe-shared"])
def test_experts_count_their_routed_share(variant: str) -> None:
    got, want = _expected(variant)
    assert got == want


def test_dense_models_read_all_but_the_untied_table() -> None:
    tied = load(parity.checkpoint_dir("llama-llama3-tied", "v4"))
    assert tied.decode_bytes == tied.nbytes  # the table is the head: read whole every step
    untied = load(parity.checkpoint_dir("llama-default", "v4"))
    (table,) = [m for _, m in named_modules(untied.network) if isinstance(m, Embedding)]
    row = _bytes(flat_parameters(table)) // untied.config["vocab_size"]
    assert untied.decode_bytes == untied.nbytes - _bytes(flat_parameters(table)) + row


def test_quantized_experts_count_their_share_too() -> None:
    got, want = _expected("qwen3_moe-sparse", {"bits": 4, "group_size": 32})
    assert got == want
