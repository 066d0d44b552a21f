"""Generation options: each GenerationOptions field's spec (type, bounds) is derived from the
dataclass, a model's Signature holds them all, and the engine refuses what they do not take."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mlx_omnia import (
    Bounds,
    GenerationOptions,
    InvalidOptionsError,
    Model,
    generation_options,
    load,
)
from mlx_omnia.engine.model import GenerationDefaults


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Model:
    return load(tiny_llama_dir)


def test_every_generation_option_is_in_the_signature(tiny: Model) -> None:
    fields = {f.name for f in dataclasses.fields(GenerationOptions)}
    # kv_bits where the cache can be quantized: not this model's 16-dim heads
    # (tests/test_kv_quantized.py)
    assert set(tiny.signature.options) == fields - {"kv_bits"}
    assert set(generation_options()) == fields
    assert "logprobs" in tiny.signature.options  # missed once when the options were a list


def test_specs_follow_the_fields_types_and_the_vocabulary(tiny: Model) -> None:
    specs = tiny.signature.options
    assert (specs["temperature"].type, specs["temperature"].shape) == (float, "value")
    assert (specs["top_k"].type, specs["max_tokens"].type) == (int, int)
    assert (specs["stop"].type, specs["stop"].shape) == (str, "sequence")
    assert (specs["logit_bias"].type, specs["logit_bias"].shape) == (float, "mapping")
    assert specs["logit_bias"].token_ids and specs["stop_token_ids"].token_ids
    assert specs["logit_bias"].vocab_size == 320  # the tiny checkpoint's vocab_size
    assert generation_options()["logit_bias"].vocab_size is None
    assert specs["top_p"].bounds == Bounds(gt=0.0, le=1.0)
    assert specs["logprobs"].bounds == Bounds(ge=0, le=20)


@pytest.mark.parametrize(
    ("options", "option", "reason"),
    [
        (GenerationOptions(stop="END"), "stop", "must be a list of strings"),
        (GenerationOptions(stop_token_ids=[5, 320]), "stop_token_ids", "names token 320, outside 0..319"),
        (GenerationOptions(seed=-1), "seed", "must be between 0 and 18446744073709551615"),
        (GenerationOptions(temperature=float("nan")), "temperature", "must be a finite number"),
        (GenerationOptions(top_k=True), "top_k", "must be an integer"),
        (GenerationOptions(logit_bias={"5": 1.0}), "logit_bias", "must map token ids to finite numbers"),
    ],
)
def test_options_out_of_their_spec_are_refused_by_name(
    tiny: Model, options: GenerationOptions, option: str, reason: str
) -> None:
    with pytest.raises(InvalidOptionsError) as info:
        tiny.stream("Hello", options)
    assert (info.value.option, info.value.reason) == (option, reason)
    assert str(info.value) == f"{option} {reason}"


def test_an_option_the_model_does_not_honour_is_refused(tiny: Model) -> None:
    without = {k: v for k, v in tiny.signature.options.items() if k != "logprobs"}
    signature = dataclasses.replace(tiny.signature, options=without)
    signature.check(GenerationOptions(temperature=0.5))  # the others still pass
    with pytest.raises(InvalidOptionsError, match="logprobs is not supported by this model") as info:
        signature.check(GenerationOptions(logprobs=2))
    assert info.value.option == "logprobs"


def test_an_api_narrows_the_bounds_it_allows() -> None:
    assert Bounds(gt=0.0, le=1.0).within(Bounds(ge=0.0, le=2.0)) == Bounds(gt=0.0, le=1.0)
    assert Bounds(ge=0.0).within(Bounds(le=2.0, max_items=4)) == Bounds(ge=0.0, le=2.0, max_items=4)
    temperature = generation_options()["temperature"].within(Bounds(le=2.0))
    temperature.check(2.0)
    with pytest.raises(InvalidOptionsError, match=r"temperature must be in \[0, 2\]"):
        temperature.check(2.5)
    bias = generation_options()["logit_bias"].within(Bounds(ge=-100, le=100))
    with pytest.raises(InvalidOptionsError, match=r"values must be in \[-100, 100\] \(token 7 has"):
        bias.check({7: 101.0})
    stop = generation_options()["stop"].within(Bounds(max_items=2, nonempty=True))
    with pytest.raises(InvalidOptionsError, match="stop must not hold an empty string"):
        stop.check(["a", ""])
    with pytest.raises(InvalidOptionsError, match="stop must hold at most 2 values"):
        stop.check(["a", "b", "c"])


def test_bounds_say_themselves_in_json_schema() -> None:
    """What an API's OpenAPI schema documents of an option is what `check` enforces."""
    specs = generation_options()
    assert specs["temperature"].within(Bounds(le=2.0)).json_schema() == {
        "minimum": 0.0, "maximum": 2.0
    }
    assert specs["top_p"].json_schema() == {"exclusiveMinimum": 0.0, "maximum": 1.0}
    assert specs["max_tokens"].within(Bounds(ge=1)).json_schema() == {"minimum": 1}
    assert specs["stop"].within(Bounds(max_items=4, nonempty=True)).json_schema() == {
        "maxItems": 4, "items": {"minLength": 1}
    }
    assert specs["logit_bias"].within(Bounds(ge=-100, le=100)).json_schema() == {
        "additionalProperties": {"minimum": -100, "maximum": 100}
    }
    assert specs["stop_token_ids"].json_schema() == {}


def test_checkpoint_defaults_out_of_range_are_left_out() -> None:
    defaults = GenerationDefaults.from_dict(
        {"do_sample": True, "temperature": -1, "top_p": 0, "top_k": 50.0, "min_p": 0.05,
         "repetition_penalty": 0, "max_new_tokens": -3}
    )
    assert defaults == GenerationDefaults(do_sample=True, top_k=50, min_p=0.05)
