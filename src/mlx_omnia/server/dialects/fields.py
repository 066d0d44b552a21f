"""Each API's request fields and what this server does with each: honoured; ignored, because
it cannot change the tokens generated for the request (client metadata, telemetry, cache
hints, service tiers); or refused by name in the dialect's error shape, because honouring it
would change the answer and this server cannot.

The dialects read their accepted-and-ignored names from here (`Endpoint.names`), so what the
table in docs/fields.md says (python -m tests.fixtures.fields_table) is what they do, and
tests/test_fields.py sends each ignored and refused field to a live server.

A path names a field as the API nests it: `a.b` a member, `a[]` each entry of a list, and
`path = value` one value (or kind) of it, e.g. `tools[].type = "web_search"`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Treatment = Literal["honoured", "ignored", "refused"]
Dialect = Literal["openai", "anthropic", "gemini"]
TREATMENTS: tuple[Treatment, ...] = ("honoured", "ignored", "refused")


@dataclass(frozen=True)
class Field:
    """One field (or one value of it) and its treatment; `why` says what is done or why not.
    `sample`: a request fragment carrying it (ignored and refused fields), merged into a
    minimal request by the tests; `named`: what a refusal names, when not the path's last word."""

    path: str
    treatment: Treatment
    why: str
    sample: Mapping[str, Any] | None = None
    named: str | None = None

    @property
    def names(self) -> str:
        """The word a refusal of this field must name."""
        if self.named is not None:
            return self.named
        field, _, value = self.path.partition(" = ")
        if value.startswith('"'):  # one kind of a field: the kind
            return value.strip('"')
        return re.findall(r"[A-Za-z_]\w*", field)[-1]


@dataclass(frozen=True)
class Endpoint:
    """One route's request fields, in the order its reference lists them."""

    dialect: Dialect
    route: str
    fields: tuple[Field, ...] = field(default=())

    def names(self, *treatments: Treatment, under: str = "") -> frozenset[str]:
        """The plain member names directly `under` a path (top level: "") of these treatments,
        e.g. the ignored ones a request may carry."""
        prefix = f"{under}." if under else ""
        out: set[str] = set()
        for f in self.fields:
            rest = f.path.removeprefix(prefix) if f.path.startswith(prefix) else None
            if rest is not None and f.treatment in treatments and re.fullmatch(r"\w+", rest):
                out.add(rest)
        return frozenset(out)

    def ignored(self, under: str = "") -> tuple[str, ...]:
        return tuple(sorted(self.names("ignored", under=under)))


def honoured(path: str, why: str) -> Field:
    return Field(path, "honoured", why)


def ignored(path: str, why: str, sample: Mapping[str, Any]) -> Field:
    return Field(path, "ignored", why, sample)


def refused(path: str, why: str, sample: Mapping[str, Any], named: str | None = None) -> Field:
    return Field(path, "refused", why, sample, named)


def _user(*content: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(content)}]


# Prompt prefixes are cached unasked (the server's prefix cache, when on); each dialect's usage
# reports the prompt tokens read from it in the vendor's own field.
_CACHE_HINT = "a cache hint; the prefix cache needs none (usage reports cached tokens)"


# -- OpenAI --------------------------------------------------------------------------------------
# Telemetry, cache hints and tiers that every OpenAI endpoint accepts and ignores.
_OPENAI_METADATA = (
    ignored("user", "an end-user id for abuse monitoring", {"user": "u-1"}),
    ignored("metadata", "stored with the object by OpenAI; kept nowhere here",
            {"metadata": {"k": "v"}}),
    ignored("service_tier", "a latency and price tier; one tier here", {"service_tier": "flex"}),
    ignored("prompt_cache_key", _CACHE_HINT, {"prompt_cache_key": "k"}),
    ignored("prompt_cache_retention", _CACHE_HINT, {"prompt_cache_retention": "24h"}),
    ignored("safety_identifier", "an end-user id for abuse monitoring",
            {"safety_identifier": "s-1"}),
)
# omnia's own field on every generating endpoint (Gemini's generationConfig.kvBits)
_KV_BITS = "this answer's KV cache as 8- or 4-bit codes, where the server allows it (--request-kv-bits)"
_SAMPLING = (
    honoured("model", "a listed model, an alias or a cached hub id"),
    honoured("stream", "server-sent events"),
    honoured("stream_options.include_usage", "a final chunk with the usage"),
    ignored("stream_options.include_obfuscation", "pads stream events only",
            {"stream": True, "stream_options": {"include_obfuscation": True}}),
    honoured("max_tokens", "up to the model's context length"),
    honoured("temperature", "0-2"),
    honoured("top_p", "nucleus sampling"),
    honoured("stop", "up to 4 strings, across token boundaries"),
    honoured("seed", "reproducible sampling; choice i of n uses seed + i"),
    honoured("presence_penalty", "-2 to 2"),
    honoured("frequency_penalty", "-2 to 2"),
    honoured("logit_bias", "token id to -100..100, added before sampling"),
    honoured("n", "1-128 choices, generated one after another"),
    honoured("kv_bits", _KV_BITS),
)
_MODERATION = "moderation of the input and output, which could withhold the answer; none here"

CHAT = Endpoint("openai", "POST /api/openai/v1/chat/completions", (
    honoured("messages", "rendered by the checkpoint's chat template"),
    honoured("messages[].role",
             "system, developer (as system), user, assistant, tool"),
    refused("messages[].role = \"function\"", "deprecated: use tool_calls and the tool role",
            {"messages": [{"role": "function", "name": "f", "content": "1"}]}, "function"),
    honoured("messages[].content[].type = \"text\"", "text parts, joined by newlines"),
    honoured("messages[].content[].type = \"refusal\"", "an assistant's refusal, as its text"),
    refused("messages[].content[].type = \"image_url\"", "the model reads text only",
            {"messages": _user({"type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA"}})}),
    refused("messages[].content[].type = \"input_audio\"", "the model reads text only",
            {"messages": _user({"type": "input_audio",
                                "input_audio": {"data": "AA", "format": "wav"}})}),
    refused("messages[].content[].type = \"file\"", "the model reads text only",
            {"messages": _user({"type": "file", "file": {"file_id": "f"}})}),
    honoured("messages[].name", "passed to the template (templates that read it show it)"),
    honoured("messages[].tool_calls", "an assistant's calls, rendered by the template"),
    honoured("messages[].tool_call_id", "a tool message's call"),
    honoured("messages[].reasoning_content", "an assistant's reasoning (vLLM's and DeepSeek's)"),
    refused("messages[].function_call", "deprecated: use tool_calls",
            {"messages": [{"role": "assistant", "content": "",
                           "function_call": {"name": "f", "arguments": "{}"}},
                          {"role": "user", "content": "hi"}]}),
    refused("messages[].audio", "audio output is not generated here",
            {"messages": [{"role": "assistant", "content": "a", "audio": {"id": "x"}},
                          {"role": "user", "content": "hi"}]}),
    *_SAMPLING,
    honoured("max_completion_tokens", "as max_tokens, which it overrides"),
    honoured("logprobs", "the sampled tokens' log-probabilities"),
    honoured("top_logprobs", "0-20 alternatives a token"),
    honoured("response_format", "text, json_object, json_schema: enforced by a grammar"),
    honoured("tools", "function tools, rendered by the template; calls parsed per format"),
    honoured("tools[].function.parameters", "the JSON Schema shown to the model"),
    ignored("tools[].function.strict",
            "arguments are held to the schema by the grammar only when a call is forced",
            {"tools": [{"type": "function",
                        "function": {"name": "f", "parameters": {}, "strict": True}}]}),
    refused("tools[].type = \"custom\"", "only function tools are declared to templates",
            {"tools": [{"type": "custom", "custom": {"name": "f"}}]}),
    honoured("tool_choice",
             "none, auto, required (a grammar), a named function, allowed_tools"),
    refused("tool_choice.type = \"custom\"", "custom tools are refused",
            {"tool_choice": {"type": "custom", "custom": {"name": "f"}}}, "tool_choice"),
    honoured("parallel_tool_calls", "false: one call an answer"),
    honoured("reasoning_effort", "a thinking template's switch and effort"),
    honoured("chat_template_kwargs", "more template variables (vLLM's and SGLang's)"),
    honoured("modalities", "[\"text\"] only; any other is refused"),
    *_OPENAI_METADATA,
    ignored("store", "stored chat completions are not kept", {"store": True}),
    ignored("prompt_cache_options", _CACHE_HINT, {"prompt_cache_options": {"mode": "implicit"}}),
    ignored("prediction", "predicted output only speeds an answer up, never changes it",
            {"prediction": {"type": "content", "content": "hello"}}),
    refused("audio", "audio output is not generated here",
            {"audio": {"voice": "alloy", "format": "wav"}}),
    refused("functions", "deprecated: use tools",
            {"functions": [{"name": "f", "parameters": {}}]}),
    refused("function_call", "deprecated: use tool_choice", {"function_call": "auto"}),
    refused("verbosity", "the model is not told to be shorter or longer", {"verbosity": "low"}),
    refused("web_search_options", "web search runs on OpenAI's servers",
            {"web_search_options": {}}),
    refused("moderation", _MODERATION, {"moderation": {"model": "omni-moderation-latest"}}),
))

COMPLETIONS = Endpoint("openai", "POST /api/openai/v1/completions", (
    honoured("prompt", "a text, or a list of one text"),
    refused("prompt = [token ids]", "send text", {"prompt": [1, 2]}, "prompt"),
    *_SAMPLING,
    honoured("max_tokens = null", "16, as OpenAI's default"),
    honoured("logprobs", "0-5 alternatives a token, with text offsets"),
    honoured("best_of = 1", "one candidate a choice"),
    refused("best_of > 1", "only best_of 1", {"best_of": 2}, "best_of"),
    honoured("echo = false", "the prompt is not repeated"),
    refused("echo = true", "the prompt is not repeated", {"echo": True}, "echo"),
    refused("suffix", "no fill-in-the-middle", {"suffix": "end"}),
    *_OPENAI_METADATA,
    ignored("store", "nothing is stored", {"store": True}),
    ignored("parallel_tool_calls", "no tools here", {"parallel_tool_calls": False}),
))

_ITEM = {"type": "message", "role": "user"}
RESPONSES = Endpoint("openai", "POST /api/openai/v1/responses", (
    honoured("model", "a listed model, an alias or a cached hub id"),
    honoured("input", "a text or input items"),
    honoured("input[].type = \"message\"", "system, developer, user, assistant messages"),
    honoured("input[].content[].type = \"input_text\"", "text"),
    honoured("input[].content[].type = \"output_text\"", "an assistant's text"),
    honoured("input[].content[].type = \"refusal\"", "an assistant's refusal, as its text"),
    refused("input[].content[].type = \"input_image\"", "the model reads text only",
            {"input": [{**_ITEM, "content": [{"type": "input_image", "image_url": "x"}]}]}),
    refused("input[].content[].type = \"input_file\"", "the model reads text only",
            {"input": [{**_ITEM, "content": [{"type": "input_file", "file_id": "f"}]}]}),
    honoured("input[].type = \"function_call\"", "an earlier call, joined to its assistant turn"),
    honoured("input[].type = \"function_call_output\"", "a tool turn"),
    honoured("input[].type = \"reasoning\"", "an earlier answer's reasoning_text"),
    refused("input[].type = \"item_reference\"", "items are not looked up; send them whole",
            {"input": [{"type": "item_reference", "id": "msg_1"}]}),
    refused("input[].type = \"web_search_call\"", "hosted tools run on OpenAI's servers",
            {"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}),
    honoured("instructions", "a system message first"),
    honoured("max_output_tokens", "up to the model's context length"),
    honoured("temperature", "0-2"),
    honoured("top_p", "nucleus sampling"),
    honoured("top_logprobs", "0-20 alternatives a token, on the output_text part"),
    honoured("kv_bits", _KV_BITS),
    honoured("stream", "the response.* event sequence"),
    honoured("store", "false: not kept for previous_response_id and GET"),
    honoured("previous_response_id", "a stored response's conversation (in memory, last 1000)"),
    honoured("include", "message.output_text.logprobs; other values add what answers here "
             "never hold"),
    honoured("reasoning.effort", "a thinking template's switch and effort"),
    ignored("reasoning.summary", "the reasoning comes back whole, never summarized",
            {"reasoning": {"summary": "auto"}}),
    ignored("reasoning.generate_summary", "as summary", {"reasoning": {"generate_summary": "auto"}}),
    honoured("text.format", "text, json_object, json_schema: enforced by a grammar"),
    honoured("text.verbosity = \"medium\"", "OpenAI's default, what every answer is"),
    refused("text.verbosity = \"low\"", "the model is not told to be shorter or longer",
            {"text": {"verbosity": "low"}}, "verbosity"),
    honoured("tools", "function tools (and Codex's namespaces of them)"),
    refused("tools[].type = \"web_search\"", "hosted tools run on OpenAI's servers",
            {"tools": [{"type": "web_search"}]}),
    refused("tools[].type = \"custom\"", "only function tools are declared to templates",
            {"tools": [{"type": "custom", "name": "f"}]}),
    honoured("tool_choice", "none, auto, required, a named function, allowed_tools"),
    honoured("parallel_tool_calls", "false: one call an answer"),
    honoured("truncation = \"disabled\"", "a prompt over the context is refused"),
    refused("truncation = \"auto\"", "the conversation is never cut here",
            {"truncation": "auto"}, "truncation"),
    *_OPENAI_METADATA,
    ignored("stream_options", "include_obfuscation pads stream events only",
            {"stream": True, "stream_options": {"include_obfuscation": False}}),
    ignored("max_tool_calls", "bounds hosted tools' calls; none run here", {"max_tool_calls": 3}),
    ignored("background_options", "background responses are refused",
            {"background_options": {}}),
    ignored("client_metadata", "what the Codex CLI says of itself",
            {"client_metadata": {"originator": "codex"}}),
    ignored("prompt_cache_options", _CACHE_HINT, {"prompt_cache_options": {"mode": "implicit"}}),
    ignored("access_programs", "account access programs; nothing in the answer depends on them",
            {"access_programs": {}}),
    ignored("image", "options of the image generation tool, which is refused", {"image": {}}),
    refused("background", "answers are not run in the background", {"background": True}),
    refused("conversation", "send the whole conversation in input", {"conversation": "conv_1"}),
    refused("prompt", "stored prompts are not kept here", {"prompt": {"id": "pmpt_1"}}),
    refused("context_management", "server-side compaction would rewrite the conversation",
            {"context_management": [{"type": "compaction", "compact_threshold": 1000}]}),
    refused("moderation", _MODERATION, {"moderation": {"model": "omni-moderation-latest"}}),
    refused("seed", "not in the Responses API", {"seed": 1}),
))

# -- Anthropic -----------------------------------------------------------------------------------
_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
_TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _anthropic(route: str, *sampling: Field) -> Endpoint:
    return Endpoint("anthropic", route, (
        honoured("model", "a listed model, an alias or a cached hub id"),
        honoured("messages", "rendered by the checkpoint's chat template"),
        honoured("messages[].role = \"system\"", "joined to the system prompt (Claude Code's)"),
        refused("messages[].name", "messages hold a role and content only",
                {"messages": [{"role": "user", "content": "hi", "name": "n"}]}, "name"),
        honoured("messages[].content[].type = \"text\"", "text blocks"),
        ignored("messages[].content[].cache_control", _CACHE_HINT,
                {"messages": _user({"type": "text", "text": "hi",
                                    "cache_control": {"type": "ephemeral"}})}),
        ignored("messages[].content[].citations", "empty or null only (citations of documents, "
                "which are refused)", {"messages": _user({"type": "text", "text": "hi",
                                                          "citations": []})}),
        refused("messages[].content[].citations = [...]", "documents are refused",
                {"messages": _user({"type": "text", "text": "hi", "citations": [{"x": 1}]})},
                "citations"),
        honoured("messages[].content[].type = \"tool_use\"", "an assistant's tool calls"),
        honoured("messages[].content[].type = \"tool_result\"", "a tool turn (is_error says so)"),
        honoured("messages[].content[].type = \"thinking\"", "an assistant's reasoning "
                 "(templates drop earlier turns')"),
        honoured("messages[].content[].type = \"redacted_thinking\"", "dropped, as templates do"),
        refused("messages[].content[].type = \"image\"", "the model reads text only",
                {"messages": _user(_IMAGE)}),
        refused("messages[].content[].type = \"document\"", "the model reads text only",
                {"messages": _user({"type": "document", "source": {
                    "type": "text", "media_type": "text/plain", "data": "x"}})}),
        refused("messages[].content[].type = \"search_result\"", "search results are not "
                "rendered", {"messages": _user({"type": "search_result", "source": "s",
                                                 "title": "t", "content": []})}),
        honoured("system", "a string or text blocks"),
        *sampling,
        honoured("thinking", "enabled (budget_tokens bounds the reasoning), adaptive, disabled; "
                 "display omitted"),
        honoured("tools", "custom tools, rendered by the template"),
        honoured("tools[].type", "custom, or absent"),
        honoured("tools[].name", "the name a call takes"),
        honoured("tools[].description", "shown to the model"),
        honoured("tools[].input_schema", "the JSON Schema shown to the model"),
        ignored("tools[].cache_control", _CACHE_HINT,
                {"tools": [{**_TOOL, "cache_control": {"type": "ephemeral"}}]}),
        ignored("tools[].defer_loading", "tool search's hint; the tool is declared all the same",
                {"tools": [{**_TOOL, "defer_loading": True}]}),
        ignored("tools[].strict", "arguments are held to the schema by the grammar only when a "
                "call is forced", {"tools": [{**_TOOL, "strict": True}]}),
        ignored("tools[].eager_input_streaming", "input is streamed as it comes anyway",
                {"tools": [{**_TOOL, "eager_input_streaming": True}]}),
        refused("tools[].input_examples", "examples are not rendered by templates",
                {"tools": [{**_TOOL, "input_examples": [{}]}]}),
        refused("tools[].allowed_callers", "no code execution calls tools here",
                {"tools": [{**_TOOL, "allowed_callers": ["direct"]}]}),
        refused("tools[].type = \"web_search_20250305\"", "server tools run on Anthropic's "
                "servers", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        honoured("tool_choice", "auto, any, tool, none; disable_parallel_tool_use"),
        honoured("output_config", "format and effort"),
        honoured("output_config.format", "json_schema: enforced by a grammar"),
        ignored("output_config.effort", "Claude's effort hint; not passed to templates (Claude "
                "Code always sends one)", {"output_config": {"effort": "high"}}),
        honoured("output_format", "the structured outputs beta's output_config.format"),
        honoured("context_management.edits[].type = \"clear_thinking_20251015\"",
                 "earlier turns' reasoning dropped"),
        honoured("context_management.edits[].type = \"clear_tool_uses_20250919\"",
                 "old tool results cleared past the trigger"),
        refused("context_management.edits[].type = \"compact_20260112\"",
                "server-side compaction would summarize the conversation",
                {"context_management": {"edits": [{"type": "compact_20260112"}]}}),
        ignored("cache_control", _CACHE_HINT, {"cache_control": {"type": "ephemeral"}}),
        ignored("speed", "a latency tier", {"speed": "fast"}),
        ignored("user_profile_id", "billing attribution", {"user_profile_id": "p"}),
        ignored("fallbacks", "substitute models for a policy refusal, which never happens here",
                {"fallbacks": ["default"]}),
        ignored("fallback_credit_token", "billing of a retried refusal",
                {"fallback_credit_token": "t"}),
        ignored("billing_policy", "billing", {"billing_policy": {"type": "billing_policy",
                                                                  "bill_to": "self"}}),
        refused("compaction", "a compaction request answers with a summary",
                {"compaction": {}}),
        refused("thread", "server-held conversations are not kept",
                {"thread": {"type": "create"}}),
        refused("mcp_servers", "MCP servers are not called from here",
                {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}),
        ignored("metadata", "an end-user id", {"metadata": {"user_id": "u"}}),
        ignored("service_tier", "one tier here", {"service_tier": "standard_only"}),
        ignored("inference_geo", "one place here", {"inference_geo": "us"}),
        ignored("diagnostics", "prompt-cache divergence reports (always null here)",
                {"diagnostics": {"previous_message_id": "msg_1"}}),
        refused("container", "code execution containers are not run here", {"container": "c"}),
    ))


MESSAGES = _anthropic(
    "POST /api/anthropic/v1/messages",
    honoured("max_tokens", "required; up to the model's context length"),
    honoured("stop_sequences", "the matched one is reported"),
    honoured("temperature", "0-1; omitted: the checkpoint's default"),
    honoured("top_p", "nucleus sampling"),
    honoured("top_k", "top-k sampling"),
    honoured("kv_bits", _KV_BITS),
    honoured("stream", "message_start ... message_stop events"),
)
COUNT_TOKENS = _anthropic("POST /api/anthropic/v1/messages/count_tokens")

# -- Gemini --------------------------------------------------------------------------------------
_PART = {"text": "hi"}


def _part(**more: Any) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{**_PART, **more}]}]}


def _media(key: str, value: Any) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{key: value}]}]}


def _config(**config: Any) -> dict[str, Any]:
    return {"generationConfig": config}


GENERATE = Endpoint("gemini", "POST /api/gemini/v1beta/models/{model}:generateContent", (
    honoured("contents", "user and model turns, rendered by the chat template"),
    honoured("contents[].parts[].text", "text"),
    honoured("contents[].parts[].thought", "an earlier thought: dropped, as templates do"),
    ignored("contents[].parts[].thoughtSignature", "proves a thought is Gemini's; nothing here",
            _part(thoughtSignature="c2ln")),
    ignored("contents[].parts[].partMetadata", "an agent's own notes, never shown to the model",
            _part(partMetadata={"source": "x"})),
    honoured("contents[].parts[].functionCall", "a model turn's tool call"),
    honoured("contents[].parts[].functionResponse", "a tool turn"),
    *(refused(f"contents[].parts[].{key}", "the model reads text only", _media(key, value))
      for key, value in (
          ("inlineData", {"mimeType": "image/png", "data": "AA"}),
          ("fileData", {"fileUri": "gs://x", "mimeType": "image/png"}),
          ("executableCode", {"language": "PYTHON", "code": "1"}),
          ("codeExecutionResult", {"outcome": "OUTCOME_OK"}),
          ("videoMetadata", {}),
          ("toolCall", {}),
          ("toolResponse", {}),
          ("mediaResolution", {}),
          ("mediaProcessing", {}),
          ("speechMetadata", {}),
          ("documentMetadata", {}),
          ("spreadsheetMetadata", {}),
          ("audioMetadata", {}),
          ("audioTranscription", {}),
      )),
    honoured("systemInstruction", "text parts (or a bare string)"),
    honoured("tools", "function declarations"),
    honoured("tools[].functionDeclarations", "function tools, rendered by the template"),
    honoured("tools[].functionDeclarations[].name", "the name a call takes"),
    honoured("tools[].functionDeclarations[].description", "shown to the model"),
    honoured("tools[].functionDeclarations[].parameters", "Gemini's Schema, as JSON Schema"),
    honoured("tools[].functionDeclarations[].parametersJsonSchema", "JSON Schema"),
    ignored("tools[].functionDeclarations[].behavior", "blocking or not: the client's matter",
            {"tools": [{"functionDeclarations": [{"name": "f", "behavior": "BLOCKING"}]}]}),
    ignored("tools[].functionDeclarations[].response", "what the function returns; templates "
            "render only the parameters",
            {"tools": [{"functionDeclarations": [{"name": "f", "response": {"type": "STRING"}}]}]}),
    ignored("tools[].functionDeclarations[].responseJsonSchema", "as response",
            {"tools": [{"functionDeclarations": [{"name": "f", "responseJsonSchema": {}}]}]}),
    *(refused(f"tools[].{key}", "server-side tools run on Google's servers",
              {"tools": [{key: {}}]})
      for key in ("googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext",
                  "retrieval", "fileSearch", "googleMaps", "computerUse", "enterpriseWebSearch",
                  "mcpServers", "parallelAiSearch", "exaAiSearch")),
    honoured("toolConfig", "how functions may be called"),
    honoured("toolConfig.functionCallingConfig", "mode and allowed names"),
    honoured("toolConfig.functionCallingConfig.mode", "AUTO, VALIDATED, ANY (a grammar), NONE"),
    honoured("toolConfig.functionCallingConfig.allowedFunctionNames", "with ANY"),
    ignored("toolConfig.functionCallingConfig.streamFunctionCallArguments",
            "a stream's calls come whole on its last chunk, with the same arguments",
            {"toolConfig": {"functionCallingConfig": {"streamFunctionCallArguments": True}}}),
    ignored("toolConfig.retrievalConfig", "the place for Maps grounding, which is refused",
            {"toolConfig": {"retrievalConfig": {"languageCode": "en"}}}),
    ignored("toolConfig.includeServerSideToolInvocations", "server-side tools are refused",
            {"toolConfig": {"includeServerSideToolInvocations": True}}),
    honoured("generationConfig", "sampling, length, format, thinking"),
    honoured("generationConfig.temperature", "temperature"),
    honoured("generationConfig.topP", "nucleus sampling"),
    honoured("generationConfig.topK", "top-k sampling"),
    honoured("generationConfig.candidateCount", "1-8 candidates, one after another"),
    honoured("generationConfig.maxOutputTokens", "up to the model's context length"),
    honoured("generationConfig.stopSequences", "up to 5"),
    honoured("generationConfig.seed", "reproducible sampling"),
    honoured("generationConfig.kvBits", _KV_BITS),
    honoured("generationConfig.presencePenalty", "presence penalty"),
    honoured("generationConfig.frequencyPenalty", "frequency penalty"),
    honoured("generationConfig.responseLogprobs", "logprobsResult and avgLogprobs"),
    honoured("generationConfig.logprobs", "0-20 alternatives a token"),
    honoured("generationConfig.responseMimeType", "text/plain, application/json, text/x.enum: "
             "enforced by a grammar"),
    honoured("generationConfig.responseSchema", "Gemini's Schema, in propertyOrdering's order"),
    honoured("generationConfig.responseJsonSchema", "JSON Schema"),
    honoured("generationConfig.responseModalities", "TEXT only"),
    honoured("generationConfig.thinkingConfig.thinkingBudget", "0 off, -1 unbounded, N tokens"),
    honoured("generationConfig.thinkingConfig.includeThoughts", "thought parts in the answer"),
    honoured("generationConfig.thinkingConfig.thinkingLevel", "a thinking template's effort"),
    ignored("generationConfig.mediaResolution", "concerns media inputs, which are refused",
            _config(mediaResolution="MEDIA_RESOLUTION_LOW")),
    honoured("generationConfig.enableEnhancedCivicAnswers = false", "the default"),
    refused("generationConfig.enableEnhancedCivicAnswers = true", "no civic answers mode",
            _config(enableEnhancedCivicAnswers=True), "enableEnhancedCivicAnswers"),
    honoured("generationConfig.audioTimestamp = false", "the default"),
    refused("generationConfig.audioTimestamp = true", "the model reads text only",
            _config(audioTimestamp=True), "audioTimestamp"),
    *(refused(f"generationConfig.{key}", why, _config(**{key: {}}))
      for key, why in (
          ("speechConfig", "speech is not generated here"),
          ("imageConfig", "images are not generated here"),
          ("audioTranscriptionConfig", "audio is not transcribed here"),
          ("translationConfig", "translation mode is not run here"),
          ("enableAffectiveDialog", "audio dialog is not run here"),
          ("routingConfig", "the request names its model; none is picked for it"),
          ("modelSelectionConfig", "the request names its model; none is picked for it"),
          ("responseFormat", "use responseMimeType and responseSchema"),
      )),
    ignored("safetySettings", "no safety filter blocks answers here",
            {"safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT",
                                 "threshold": "BLOCK_NONE"}]}),
    ignored("labels", "billing labels", {"labels": {"team": "a"}}),
    ignored("serviceTier", "one tier here", {"serviceTier": "flex"}),
    ignored("store", "request logging; nothing is logged", {"store": False}),
    ignored("model", "the path names the model", {"model": "models/other"}),
    refused("cachedContent", "cached contents are not kept here",
            {"cachedContent": "cachedContents/x"}),
    refused("continuationToken", "answers never stop to continue here",
            {"continuationToken": "t"}),
    refused("modelArmorConfig", "prompt and response sanitization is not run here",
            {"modelArmorConfig": {}}),
))
COUNT_GEMINI = Endpoint("gemini", "POST /api/gemini/v1beta/models/{model}:countTokens", (
    honoured("contents", "counted as generateContent renders them"),
    honoured("generateContentRequest", "a whole request, counted with its system instruction "
             "and tools"),
    refused("generationConfig", "send it inside generateContentRequest",
            {"generationConfig": {}}),
))

ENDPOINTS: tuple[Endpoint, ...] = (
    CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, GENERATE, COUNT_GEMINI
)
