"""Grammar-constrained decoding (GenerationOptions.constraint, llguidance): what SmolLM2 writes
under a JSON schema, a Lark grammar or a regex matches it, even sampled hot; a grammar llguidance
refuses is refused by name before generation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mlx_omnia import (
    Chat,
    Constraint,
    ConstraintError,
    GenerationOptions,
    InvalidOptionsError,
    Model,
    generation_options,
    load,
)
from mlx_omnia.engine.generate.grammar import GrammarMask
from tests.fixtures.tiny import write_tiny_llama

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}

ASK = Chat(({"role": "user", "content": "Describe a person as JSON."},))


@pytest.mark.parametrize("seed", range(10))
def test_hot_sampling_under_a_json_schema_gives_valid_json(smollm2: Model, seed: int) -> None:
    options = GenerationOptions(
        constraint=Constraint.json_schema(PERSON), temperature=1.5, seed=seed, max_tokens=80
    )
    out = smollm2.generate(ASK, options)
    assert out.finish_reason == "stop"  # the grammar completed, then the end token
    assert out.token_ids[-1] in smollm2.tokenizer.eos_token_ids
    jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_mode_gives_a_json_object(smollm2: Model) -> None:
    ask = Chat(({"role": "user", "content": "Give me a JSON object with your name and age."},))
    out = smollm2.generate(ask, GenerationOptions(constraint=Constraint.json_schema(), max_tokens=40))
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_a_lark_grammar_is_followed_exactly(smollm2: Model) -> None:
    grammar = r"""
        start: "The answer is " ANSWER "."
        ANSWER: "yes" | "no" | /[0-9]{1,3}/
    """
    ask = Chat(({"role": "user", "content": "Is Paris in France?"},))
    for seed in range(3):
        options = GenerationOptions(constraint=Constraint.lark(grammar), temperature=1.5, seed=seed)
        out = smollm2.generate(ask, options)
        assert re.fullmatch(r"The answer is (yes|no|[0-9]{1,3})\.", out.text), out.text
        assert out.finish_reason == "stop"


def test_a_lark_grammar_with_an_inline_json_rule(smollm2: Model) -> None:
    grammar = 'start: "Colour: " %json {"enum": ["red", "green", "blue"]}'
    options = GenerationOptions(constraint=Constraint.lark(grammar), seed=1)
    out = smollm2.generate(ASK, options)
    assert out.text in ('Colour: "red"', 'Colour: "green"', 'Colour: "blue"')


def test_a_regex_is_matched_by_the_whole_output(smollm2: Model) -> None:
    ask = Chat(({"role": "user", "content": "When was the Eiffel Tower built?"},))
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    for seed in range(2):
        options = GenerationOptions(constraint=Constraint.regex(pattern), temperature=1.0, seed=seed)
        out = smollm2.generate(ask, options)
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop" and out.usage.completion_tokens <= 11


def test_max_tokens_still_cuts_a_constrained_answer(smollm2: Model) -> None:
    options = GenerationOptions(constraint=Constraint.json_schema(PERSON), max_tokens=5)
    out = smollm2.generate(ASK, options)
    assert out.finish_reason == "length" and out.usage.completion_tokens == 5
    assert out.text.startswith('{"name": "')


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint.lark("start: /[a-z/"), "is not a valid Lark grammar: "),
        (Constraint.lark("start: missing_rule"), "is not a valid Lark grammar: "),
        (Constraint.regex("a(b"), "is not a valid regex: "),
        (Constraint.json_schema({"type": "nonsense"}), "is not a valid JSON schema: "),
    ],
)
def test_a_grammar_llguidance_refuses_is_refused_by_name(
    smollm2: Model, constraint: Constraint, says: str
) -> None:
    with pytest.raises(InvalidOptionsError) as info:
        smollm2.stream(ASK, GenerationOptions(constraint=constraint))
    assert info.value.option == "constraint"
    assert info.value.reason.startswith(says) and len(info.value.reason) > len(says)
    assert str(info.value).startswith("constraint " + says)
    with pytest.raises(InvalidOptionsError):  # the grammar alone, without a model
        generation_options()["constraint"].check(constraint)


def test_the_constraint_option_takes_a_constraint_and_documents_nothing() -> None:
    spec = generation_options()["constraint"]
    assert spec.type is Constraint and spec.json_schema() == {}
    spec.check(Constraint.regex("[0-9]+"))
    with pytest.raises(InvalidOptionsError, match="constraint must be a Constraint"):
        spec.check('{"type": "object"}')


def test_streaming_and_generate_give_the_same_constrained_text(smollm2: Model) -> None:
    options = GenerationOptions(
        constraint=Constraint.json_schema(PERSON), temperature=1.2, seed=7, max_tokens=30
    )
    whole = smollm2.generate(ASK, options)
    pieces = list(smollm2.stream(ASK, options))
    assert "".join(p.text for p in pieces) == whole.text
    assert tuple(t for p in pieces for t in p.token_ids) == whole.token_ids


def test_logprobs_stay_the_models_own_under_a_constraint(smollm2: Model) -> None:
    """The mask decides what can be sampled; the log-probabilities reported are the model's."""
    options = GenerationOptions(constraint=Constraint.regex("Paris"), logprobs=2, max_tokens=4)
    out = smollm2.generate(Chat(({"role": "user", "content": "Capital of France?"},)), options)
    assert out.text == "Paris"
    assert [p.token_id for p in out.logprobs] == list(out.token_ids[:-1])
    free = smollm2.generate(
        Chat(({"role": "user", "content": "Capital of France?"},)),
        GenerationOptions(logprobs=2, max_tokens=1),
    )
    assert out.logprobs[0].top == free.logprobs[0].top  # same step, same model distribution


def test_a_checkpoint_whose_vocab_rows_pass_its_tokenizer(tmp_path: Path) -> None:
    """An HF tokenizer.json checkpoint whose config pads vocab_size past the tokenizer's 320
    tokens: the mask covers every logits row, and the padding rows are never allowed."""
    tiny = load(write_tiny_llama(tmp_path, vocab_size=352))
    assert tiny.grammar_tokenizer().vocab_size == 352
    for seed in range(3):
        options = GenerationOptions(constraint=Constraint.regex("[ab]{3}c"), temperature=1.0, seed=seed)
        out = tiny.generate("Hello", options)
        assert re.fullmatch("[ab]{3}c", out.text) and out.finish_reason == "stop", out.text
        assert all(t < 320 for t in out.token_ids)


def test_a_token_the_constraint_refuses_is_an_engine_error(smollm2: Model) -> None:
    """Mid-answer, a matcher that fails ends the generation with ConstraintError, not garbage."""
    mask = GrammarMask(Constraint.regex("a+"), smollm2.grammar_tokenizer())
    b = smollm2.tokenizer.token_to_id("b")
    assert b is not None and not mask.words[b // 32] >> (b % 32) & 1
    with pytest.raises(ConstraintError, match=f"token {b} was refused"):
        mask.follow(b)
