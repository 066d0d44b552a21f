"""Structured output in every dialect, through the official SDKs against one real server and the
real SmolLM2-135M-Instruct: OpenAI chat's response_format, Responses' text.format, Anthropic's
output_config.format (and the beta's output_format), Gemini's responseMimeType with
responseSchema / responseJsonSchema. Decoding is masked by the schema's grammar, so even hot
sampling gives valid answers; what cannot be enforced is refused, naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from google import genai
from google.genai import errors, types

from mlx_omnia.server.settings import Settings
from tests.server_harness import LiveServer, live_server

MODEL = "smollm2-135m-instruct"
PROMPT = "Describe a person as JSON: name, age, favourite color, two tags."
# Compact on purpose (about 30 tokens an answer at 10 tokens a second): every kind of field,
# each bounded so that hot sampling ends well inside MAX_TOKENS.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
# The same schema as Gemini's Schema (OpenAPI's subset) writes it.
GEMINI_SCHEMA: dict[str, Any] = {
    "type": "OBJECT",
    "properties": {
        "name": {"type": "STRING", "maxLength": 8},
        "age": {"type": "INTEGER", "minimum": 0, "maximum": 99},
        "color": {"type": "STRING", "format": "enum", "enum": ["red", "green", "blue"]},
        "tags": {"type": "ARRAY", "items": {"type": "STRING", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "propertyOrdering": ["color", "name", "age", "tags"],
}
MAX_TOKENS = 64
JSON_MODE_TOKENS = 40  # JSON mode's objects have no bound: a cut one still starts as one
RUNS = 10
HOT = 1.5  # far past what a model keeps to a format by itself
BAD_SCHEMA = {"type": "bogus"}  # llguidance cannot compile it
WEATHER = {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def valid(text: str, schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url + "/api/anthropic", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def gemini(server: LiveServer) -> genai.Client:
    return genai.Client(
        api_key="x",
        http_options=types.HttpOptions(base_url=server.url + "/api/gemini", api_version="v1beta"),
    )


def user(text: str = PROMPT) -> list[Any]:
    return [{"role": "user", "content": text}]


# -- OpenAI chat: response_format ------------------------------------------------------------
def json_schema_format(schema: dict[str, Any] = SCHEMA, **more: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **more}}


def test_chat_json_schema_holds_over_hot_samples(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=MAX_TOKENS, temperature=HOT, seed=7, n=RUNS,
        response_format=json_schema_format(strict=False, description="a person"),  # type: ignore[arg-type]
    )
    assert len(r.choices) == RUNS
    answers = [valid(c.message.content or "") for c in r.choices]
    assert all(c.finish_reason == "stop" for c in r.choices)
    assert len({json.dumps(a) for a in answers}) > 1  # sampled, not one answer ten times


def test_chat_json_schema_streamed(oai: openai.OpenAI) -> None:
    chunks = oai.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=MAX_TOKENS, temperature=HOT, seed=3, stream=True,
        response_format=json_schema_format(strict=True),  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    valid(text)


def test_chat_json_object_is_any_object(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL, messages=user("Give me a JSON object about Paris."), max_tokens=JSON_MODE_TOKENS,
        temperature=0, response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # cut at max_tokens: still an object's beginning
        assert (r.choices[0].message.content or "").startswith("{")
    text = oai.chat.completions.create(
        model=MODEL, messages=user("Say hi."), max_tokens=2, temperature=0,
        response_format={"type": "text"},
    )
    assert text.choices[0].message.content


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "response_format.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (json_schema_format(BAD_SCHEMA), "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
         "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}},
         "response_format.json_schema.name"),
        (json_schema_format(strict="yes"), "response_format.json_schema.strict"),
        (json_schema_format(example={}), "response_format.json_schema.example"),
        (json_schema_format([]), "response_format.json_schema.schema"),  # type: ignore[arg-type]
    ],
)
def test_chat_bad_response_format_names_the_field(
    oai: openai.OpenAI, response_format: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=2, extra_body={"response_format": response_format}
        )
    assert info.value.param == param
    with pytest.raises(openai.BadRequestError) as info:  # a stream refuses before it starts
        oai.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=2, stream=True,
            extra_body={"response_format": response_format},
        )
    assert info.value.param == param


def test_chat_bad_schema_says_why(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=2,
            response_format=json_schema_format(BAD_SCHEMA),  # type: ignore[arg-type]
        )
    assert "response_format.json_schema.schema is not a valid JSON schema" in info.value.message
    assert "bogus" in info.value.message


def test_chat_response_format_with_a_required_tool_call_is_refused(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=2, tool_choice="required",
            tools=[{"type": "function", "function": WEATHER}],
            response_format=json_schema_format(),  # type: ignore[arg-type]
        )
    assert info.value.param == "response_format.json_schema.schema"
    assert "cannot be combined with a required tool call" in info.value.message


# -- OpenAI Responses: text.format -----------------------------------------------------------
def text_format(schema: dict[str, Any] = SCHEMA, **more: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "person", "schema": schema, **more}}


def test_responses_json_schema_holds_over_hot_samples(oai: openai.OpenAI) -> None:
    texts = [
        oai.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=HOT,
            text=text_format(strict=True),  # type: ignore[arg-type]
        ).output_text
        for _ in range(RUNS)
    ]
    answers = [valid(t) for t in texts]
    assert len({json.dumps(a) for a in answers}) > 1


def test_responses_json_schema_streamed_and_echoed(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=HOT, stream=True,
        text={**text_format(), "verbosity": "medium"},  # type: ignore[arg-type]
    ))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    valid(text)
    last = events[-1]
    assert last.type == "response.completed"
    fmt = last.response.text.format if last.response.text else None
    assert fmt is not None and fmt.type == "json_schema"


def test_responses_json_object(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model=MODEL, input="Give me a JSON object about Paris.", max_output_tokens=JSON_MODE_TOKENS,
        temperature=0, text={"format": {"type": "json_object"}},
    )
    assert r.output_text.startswith("{")
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ({"format": {"type": "json_schema", "name": "person"}}, "text.format.schema"),
        (text_format(BAD_SCHEMA), "text.format.schema"),
        ({"format": {"type": "json_schema", "name": "", "schema": {}}}, "text.format.name"),
        ({"format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}},
         "text.format.json_schema"),
        ({"format": {"type": "grammar"}}, "text.format.type"),
        ({"verbosity": "low"}, "text.verbosity"),
        ({"stop": "x"}, "text.stop"),
    ],
)
def test_responses_bad_text_names_the_field(
    oai: openai.OpenAI, text: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=2, extra_body={"text": text}
        )
    assert info.value.param == param


# -- Anthropic: output_config ----------------------------------------------------------------
def output_config(schema: dict[str, Any] = SCHEMA, **more: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "schema": schema}, **more}


def test_anthropic_output_config_holds_over_sampled_runs(claude: anthropic.Anthropic) -> None:
    answers: list[dict[str, Any]] = []
    for _ in range(RUNS):
        msg = claude.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=user(),
            output_config=output_config(effort="high"),  # type: ignore[arg-type]
            extra_body={"temperature": 1.0},  # Anthropic's temperature stops at 1
        )
        assert msg.stop_reason == "end_turn" and msg.content[0].type == "text"
        answers.append(valid(msg.content[0].text))
    assert len({json.dumps(a) for a in answers}) > 1


def test_anthropic_output_config_streamed(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=user(),
        output_config=output_config(),  # type: ignore[arg-type]
        extra_body={"temperature": 1.0},
    ) as stream:
        text = "".join(stream.text_stream)
    valid(text)


def test_anthropic_beta_output_format_and_effort_alone(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=user(),
        extra_body={"temperature": 0, "output_format": output_config()["format"]},
    )
    assert msg.content[0].type == "text"
    valid(msg.content[0].text)
    for effort in ("low", "medium", "high", "xhigh", "max"):
        msg = claude.messages.create(
            model=MODEL, max_tokens=2, messages=user("Hi"), output_config={"effort": effort},
            extra_body={"temperature": 0},
        )
        assert msg.content[0].type == "text" and msg.content[0].text
    tokens = claude.messages.count_tokens(
        model=MODEL, messages=user(), output_config=output_config(effort="max")  # type: ignore[arg-type]
    )
    assert tokens.input_tokens > 0


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"task_budget": {"total": 100}}}, "output_config.task_budget"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_config": output_config(BAD_SCHEMA)},
         "output_config.format.schema is not a valid JSON schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}, "strict": True}}},
         "output_config.format.strict"),
        ({"output_config": output_config(), "output_format": output_config()["format"]},
         "output_format"),
        ({"output_format": {"type": "json_schema", "schema": "{}"}}, "output_format.schema"),
        ({"output_config": output_config(), "tool_choice": {"type": "any"},
          "tools": [{"name": "weather", "input_schema": WEATHER["parameters"]}]},
         "output_config.format.schema cannot be combined with a required tool call"),
    ],
)
def test_anthropic_bad_output_config_names_the_field(
    claude: anthropic.Anthropic, extra: dict[str, Any], field: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=2, messages=user(), extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]


# -- Gemini: responseMimeType with responseSchema / responseJsonSchema -----------------------
def gemini_config(**config: Any) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(max_output_tokens=MAX_TOKENS, **config)


def test_gemini_response_schema_holds_over_hot_samples(gemini: genai.Client) -> None:
    answers: list[dict[str, Any]] = []
    for seed in (1, 2):  # candidateCount stops at 8: two requests of five
        r = gemini.models.generate_content(model=MODEL, contents=PROMPT, config=gemini_config(
            response_mime_type="application/json", response_schema=GEMINI_SCHEMA,
            temperature=HOT, seed=seed, candidate_count=RUNS // 2,
        ))
        assert r.candidates is not None and len(r.candidates) == RUNS // 2
        for c in r.candidates:
            assert c.content is not None and c.content.parts and c.finish_reason == "STOP"
            text = c.content.parts[0].text or ""
            assert text.startswith('{"color": ')  # propertyOrdering is the order written
            answers.append(valid(text))
    assert len({json.dumps(a) for a in answers}) > 1


def test_gemini_response_json_schema_streamed(gemini: genai.Client) -> None:
    chunks = gemini.models.generate_content_stream(model=MODEL, contents=PROMPT, config=gemini_config(
        response_mime_type="application/json", response_json_schema=SCHEMA, temperature=HOT,
        seed=4,
    ))
    valid("".join(c.text or "" for c in chunks))


def test_gemini_json_mode_and_enum_mode(gemini: genai.Client) -> None:
    r = gemini.models.generate_content(
        model=MODEL, contents="Give me a JSON object about Paris.",
        config=types.GenerateContentConfig(
            response_mime_type="application/json", temperature=0, max_output_tokens=JSON_MODE_TOKENS
        ),
    )
    assert (r.text or "")[:1] in ("{", "[")  # an object or an array
    colors = ["red", "green", "dark blue (navy)"]
    for seed in range(3):
        r = gemini.models.generate_content(
            model=MODEL, contents="Which color is the sky?",
            config=gemini_config(
                response_mime_type="text/x.enum", temperature=HOT, seed=seed,
                response_schema={"type": "STRING", "format": "enum", "enum": colors},
            ),
        )
        assert r.text in colors


def _gemini_error(gemini: genai.Client, config: types.GenerateContentConfig) -> errors.ClientError:
    with pytest.raises(errors.ClientError) as e:
        gemini.models.generate_content(model=MODEL, contents=PROMPT, config=config)
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    return e.value


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (types.GenerateContentConfig(response_schema=GEMINI_SCHEMA), "responseSchema needs"),
        (types.GenerateContentConfig(response_mime_type="text/plain", response_json_schema=SCHEMA),
         "responseJsonSchema needs"),
        (types.GenerateContentConfig(response_mime_type="text/x.enum"), "responseMimeType"),
        (types.GenerateContentConfig(response_mime_type="text/x.enum", response_schema=GEMINI_SCHEMA),
         "string enum"),
        (types.GenerateContentConfig(response_mime_type="text/html"), "responseMimeType"),
        (types.GenerateContentConfig(
            response_mime_type="application/json", response_json_schema=BAD_SCHEMA),
         "generationConfig.responseJsonSchema is not a valid JSON schema"),
        (types.GenerateContentConfig(
            response_mime_type="application/json",
            response_schema={"type": "OBJECT", "propertyOrdering": ["x"], "properties": {}}),
         "propertyOrdering"),
        (types.GenerateContentConfig(
            response_mime_type="application/json", response_schema=GEMINI_SCHEMA,
            tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
                name="weather", parameters_json_schema=WEATHER["parameters"])])],
            tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY)),
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True)),
         "responseSchema cannot be combined with a required tool call"),
    ],
)
def test_gemini_bad_structured_output_names_the_field(
    gemini: genai.Client, config: types.GenerateContentConfig, field: str
) -> None:
    assert field in (_gemini_error(gemini, config).message or "")
