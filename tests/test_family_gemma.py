"""gemma family checks beyond tests/test_parity.py: the Gemma tokenizer (SentencePiece-style:
"▁" for spaces, byte fallback, <bos> added to a raw prompt) and chat template agree with
transformers on more inputs, refused variants, and the MLX-quantized form round-trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import ChatTemplateError, UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity

TEXTS = [
    "Hello world",
    " leading space and  double  spaces ",
    "unseen: Ωμέγα ß ø 🦀 \u00a0nbsp",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already there",
    "tabs\tand\r\nwindows lines 0123",
]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("schema", parity.SCHEMAS)
def test_tokenizer_matches_transformers(schema: str) -> None:
    from transformers import AutoTokenizer

    d = parity.checkpoint_dir("gemma-tied", schema)
    ref = AutoTokenizer.from_pretrained(str(d))
    tok = load(d, dtype="float32").tokenizer
    assert tok.bos_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(ref(text).input_ids), text
        assert ids[0] == 2  # <bos>, as Gemma expects
        assert tok.encode(text, add_special_tokens=False) == list(
            ref(text, add_special_tokens=False).input_ids
        )
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    chat = [
        {"role": "user", "content": "  Hi there  "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.chat_template is not None
    rendered = tok.chat_template.render(chat, add_generation_prompt=False)
    assert rendered == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    assert rendered.startswith("<bos><start_of_turn>user\nHi there<end_of_turn>\n")
    assert "<start_of_turn>model\nHello!<end_of_turn>" in rendered
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert ids[0] == 2 and ids.count(2) == 1  # the template's <bos>, not a second one
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_refused_variants() -> None:
    config = read_json(parity.checkpoint_dir("gemma-tied", "v4") / "config.json")
    family = family_for("gemma")
    family.build({**config, "hidden_act": "gelu"})  # the legacy name of the tanh GELU
    family.build({**config, "hidden_activation": "gelu_pytorch_tanh"})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        family.build({**config, "hidden_act": "relu"})
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        family.build({**config, "hidden_activation": "gelu_new"})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        family.build({**config, "use_bidirectional_attention": True})


def test_quantized_round_trip(tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model (measured max rel 4-bit error 0.52: the tied,
    sqrt(hidden)-scaled embedding is quantized too, and uniform random weights are hard on 4
    bits)."""
    d = parity.checkpoint_dir("gemma-tied", "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.7
