"""lfm2 family checks beyond tests/test_parity.py: the config's spellings and refusals, that the
fixtures exercise the convolutions, the recurrent state through every decode path (chunked
prefill, the compiled step, a Batch, which runs such a model one sequence at a time and keeps
no prefix), and the MLX-quantized round trip."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import GenerationOptions, load
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.mxcompat import flat_parameters, set_parameters
from mlx_omnia.engine.core.recurrent import ShortConv
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.generate import loop
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.lfm2.config import Lfm2Config, feed_forward_size
from tests import hybrid_checks
from tests.fixtures import parity
from tests.server_harness import live_server, openai_client
from tests.test_batch import ask

VARIANTS = ["lfm2-hybrid", "lfm2-bias"]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


@pytest.mark.parametrize(
    ("change", "size"),
    [
        ({"intermediate_size": 12288}, 8192),  # LFM2-1.2B: 2/3, rounded up to 256
        ({"intermediate_size": 100, "block_multiple_of": 64}, 128),
        ({"block_ff_dim": 100, "block_multiple_of": 64}, 128),  # the hub's spelling
        ({"intermediate_size": 100, "block_ffn_dim_multiplier": None}, 66),  # no rounding
        ({"intermediate_size": 100, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 8}, 104),
        ({"intermediate_size": 100, "block_auto_adjust_ff_dim": False}, 100),
    ],
)
def test_feed_forward_size(change: dict[str, Any], size: int) -> None:
    assert feed_forward_size(change) == size


def test_layer_kinds_from_either_spelling() -> None:
    base = config("lfm2-hybrid")
    want = ("conv", "full_attention", "conv", "conv", "full_attention")
    assert Lfm2Config.from_dict(base).layer_types == want
    old = {k: v for k, v in base.items() if k != "layer_types"}
    assert Lfm2Config.from_dict({**old, "full_attn_idxs": [1, 4]}).layer_types == want
    assert set(Lfm2Config.from_dict(old).layer_types) == {"full_attention"}  # neither: all


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["conv", "mamba", "conv", "conv", "full_attention"]}, "mamba"),
        ({"layer_types": ["conv"]}, "names 1 layers"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}, "yarn"),
        ({"block_use_swiglu": False}, "block_use_swiglu"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("lfm2").build({**config("lfm2-hybrid"), **change})


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_convolutions_count(variant: str) -> None:
    """Same weights with every convolution's taps but the last zeroed (each token sees only
    itself): the logits move far past the parity tolerance, so parity checks the taps over
    earlier tokens, the bias (lfm2-bias) and the gating."""
    d = parity.checkpoint_dir(variant, "v5")
    model = load(d, dtype="float32")
    other = family_for("lfm2").build(config(variant))
    params = flat_parameters(model.network)
    set_parameters(other, list(params.items()))
    for _, module in other.named_modules():
        if isinstance(module, ShortConv):
            module.weight = module.weight * (mx.arange(module.kernel_size) == module.kernel_size - 1)
    bind_layers(other)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    assert _rel(np.array(other(ids)[0]), np.array(model.network(ids)[0])) > 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_and_the_compiled_step_carry_the_state(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt prefilled in chunks of 5 (five chunks), then 8 tokens decoded by the compiled
    step, gives the logits of the whole sequence in one eager call."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    ids = list(parity.PROMPT_IDS)
    whole = np.array(model.network(mx.array([ids], dtype=mx.int32))[0])
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 5)
    monkeypatch.setenv("OMNIA_COMPILE", "1")
    with model.decoding() as d:
        rows = [d.feed(ids[:16], last_only=True)] + [d.feed([t]) for t in ids[16:]]
        assert d._step is not None  # the compiled step ran the single tokens
        assert any(isinstance(c, RecurrentState) for c in d._cache)
    got = np.array(mx.concatenate(rows, axis=0))
    tol = max(10 * parity.load_reference(variant).info["fp32_fp64_spread"], 1e-5)
    assert _rel(got, whole[15:]) <= tol


def test_greedy_generation_compiled_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir("lfm2-hybrid", "v5"), dtype="float32")
    answers = []
    for compiled in ("1", "0"):
        monkeypatch.setenv("OMNIA_COMPILE", compiled)
        answers.append(model.generate("Tell me a story", GenerationOptions(max_tokens=24)).token_ids)
    assert answers[0] == answers[1] and len(answers[0]) > 8


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_batched_greedy_equals_each_alone(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIA_COMPILE", compiled)
    model = load(parity.checkpoint_dir("lfm2-hybrid", "v5"), dtype="float32")
    assert model.signature.batched
    hybrid_checks.batched_equals_alone(model)


def test_a_resent_conversation_resumes_from_the_prefix_cache(tmp_path: Path) -> None:
    model = load(parity.checkpoint_dir("lfm2-hybrid", "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits; the projections quantized, the
    convolutions' taps not. Measured max rel error: 4 bits 0.65 (hybrid, five layers) / 0.20
    (bias), 8 bits 0.041 / 0.0096: 16x apart, as 4 more bits should make them."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    convs = [m for _, m in q.network.named_modules() if isinstance(m, ShortConv)]
    assert convs and all(m.weight.dtype == mx.float32 for m in convs)
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.8
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert _rel(q8, ref) < 0.06


def test_the_server_serves_it_to_several_clients(tmp_path: Path) -> None:
    """Three OpenAI-SDK clients at once (batched) get each the answer the library gives alone;
    a long conversation sent again is answered the same from the prefix cache, its cached
    tokens reported (the server's blocks of 256 tokens: the convolutions resume from an
    anchor)."""
    src = parity.checkpoint_dir("lfm2-hybrid", "v5")
    path = Path(shutil.copytree(src, tmp_path / "lfm2-hybrid"))
    model = load(path, dtype="float32")
    long = " ".join(hybrid_checks.WORDS[i % 24] for i in range(60))  # > 256 tokens
    questions = [long, "What is two plus two?", "Name a colour"]
    want = [
        model.generate(ask(q), GenerationOptions(max_tokens=12)).text
        for q in questions
    ]
    with live_server(models=[path]) as server:
        client = openai_client(server)

        def chat(q: str) -> tuple[str, int | None]:
            r = client.chat.completions.create(
                model="lfm2-hybrid", messages=[{"role": "user", "content": q}],
                max_tokens=12, temperature=0,
            )
            details = r.usage.prompt_tokens_details if r.usage else None
            return r.choices[0].message.content or "", details.cached_tokens if details else None

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(chat, questions))
        assert [text for text, _ in got] == want
        again, cached = chat(questions[0])
        assert again == want[0] and cached is not None and cached >= 256
