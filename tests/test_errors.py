"""Bad input raises typed errors whose message says what to do, never a crash or a bare
exception from a library underneath."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from mlx_omnia import (
    Chat,
    ChatTemplateError,
    CheckpointError,
    ContextLengthError,
    GenerationOptions,
    InvalidOptionsError,
    ModelNotFoundError,
    OmniaError,
    TokenizerError,
    UnsupportedModelError,
    load,
)
from tests.fixtures.tiny import write_tiny_llama

HELLO = Chat(({"role": "user", "content": "Hello"},))


@pytest.fixture
def ckpt(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load(tiny_llama_dir)


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _edit_tensors(ckpt: Path, fn) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


# -- the checkpoint directory --------------------------------------------------------------------


def test_unknown_model_type_lists_supported(ckpt: Path) -> None:
    _edit_json(ckpt / "config.json", model_type="mamba9")
    with pytest.raises(UnsupportedModelError, match=r"'mamba9' is not supported") as info:
        load(ckpt)
    assert "llama" in str(info.value) and "supported:" in str(info.value)


def test_config_without_model_type(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    del config["model_type"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no model_type"):
        load(ckpt)


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load(ckpt)


def test_invalid_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CheckpointError, match=r"not valid JSON.*re-download"):
        load(ckpt)


def test_config_json_not_an_object(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match=r"must hold a JSON object"):
        load(ckpt)


def test_missing_tokenizer_json(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json.*save_pretrained"):
        load(ckpt)


def test_corrupt_tokenizer_json(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"could not be read"):
        load(ckpt)


def test_missing_safetensors(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load(ckpt)


def test_index_naming_a_missing_shard(ckpt: Path) -> None:
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing shard.*model-00002-of-00002"):
        load(ckpt)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load(ckpt)


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    def add(t: dict) -> None:
        t["model.layers.0.self_attn.extra_gate.weight"] = t["model.norm.weight"].copy()

    _edit_tensors(ckpt, add)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra_gate"
    ):
        load(ckpt)


def test_wrong_tensor_shape(ckpt: Path) -> None:
    def shrink(t: dict) -> None:
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"][:100]

    _edit_tensors(ckpt, shrink)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(100, 64\)"
    ):
        load(ckpt)


def test_config_disagreeing_with_tensors(ckpt: Path) -> None:
    _edit_json(ckpt / "config.json", intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"implies"):
        load(ckpt)


@pytest.mark.parametrize("keep", [0, 5, 100, 2000, -1])
def test_truncated_safetensors(ckpt: Path, keep: int) -> None:
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CheckpointError, match=r"corrupt or truncated.*download"):
        load(ckpt)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00" * 4096,
        b"\xff" * 4096,
        (12).to_bytes(8, "little") + b"not json!!!!" + b"\x00" * 64,
        (2).to_bytes(8, "little") + b"[]",
        (8).to_bytes(8, "little") + b'{"a": 5}',
        (2**40).to_bytes(8, "little") + b"{}",
        (40).to_bytes(8, "little") + b'{"a": {"dtype": "F32", "shape": [2]}}   ',
        b"<html>404 Not Found</html>" * 10,
    ],
)
def test_garbage_safetensors(ckpt: Path, payload: bytes) -> None:
    (ckpt / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError):
        load(ckpt)


def test_never_executes_remote_code(tmp_path: Path) -> None:
    """auto_map/trust_remote_code name Python files; the engine never imports them."""
    marker = tmp_path / "PWNED"
    evil = (
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('imported')\n"
        "class EvilForCausalLM: pass\nclass EvilConfig: pass\nclass EvilTokenizer: pass\n"
    )
    auto_map = {
        "AutoConfig": "modeling_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    # A custom architecture: a clear refusal.
    custom = write_tiny_llama(tmp_path / "custom")
    (custom / "modeling_evil.py").write_text(evil)
    (custom / "configuration_evil.py").write_text(evil)
    (custom / "__init__.py").write_text(evil)
    _edit_json(custom / "config.json", model_type="evil", auto_map=auto_map, trust_remote_code=True)
    _edit_json(
        custom / "tokenizer_config.json",
        auto_map={"AutoTokenizer": ["modeling_evil.EvilTokenizer", None]},
    )
    with pytest.raises(UnsupportedModelError, match=r"'evil' is not supported"):
        load(custom)
    assert not marker.exists()
    # A known architecture that merely carries an auto_map: loads normally, code untouched.
    known = write_tiny_llama(tmp_path / "known")
    (known / "modeling_evil.py").write_text(evil)
    _edit_json(known / "config.json", auto_map=auto_map, trust_remote_code=True)
    _edit_json(
        known / "tokenizer_config.json",
        auto_map={"AutoTokenizer": ["modeling_evil.EvilTokenizer", None]},
    )
    model = load(known)
    assert model.generate("Hello", GenerationOptions(max_tokens=2)).usage.completion_tokens == 2
    assert not marker.exists()


# -- model references and load options -----------------------------------------------------------


def test_unknown_model_name() -> None:
    with pytest.raises(ModelNotFoundError, match=r"neither a local checkpoint directory") as info:
        load("no-such-model")
    assert "hub repo id" in str(info.value)


def test_missing_local_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load(tmp_path / "nothing" / "here")


def test_uncached_hub_repo_offline() -> None:
    with pytest.raises(ModelNotFoundError, match=r"not in the local HF cache"):
        load("mlx-omnia-tests/definitely-not-a-repo", local_files_only=True)


def test_non_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        load(tmp_path / "weights.bin")


def test_garbage_gguf(tmp_path: Path) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"GGML" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"not a GGUF file"):
        load(tmp_path / "broken.gguf")
    (tmp_path / "truncated.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(CheckpointError, match=r"could not be read as GGUF"):
        load(tmp_path / "truncated.gguf")


@pytest.mark.parametrize("dtype", ["int8", "fp32", "float64"])
def test_bad_dtype(tiny_llama_dir: Path, dtype: str) -> None:
    with pytest.raises(InvalidOptionsError, match=r"is not one of float32, bfloat16, float16"):
        load(tiny_llama_dir, dtype=dtype)


# -- chat templates -------------------------------------------------------------------------------


def test_no_chat_template_with_a_chat(tmp_path: Path) -> None:
    model = load(write_tiny_llama(tmp_path / "plain", chat_template=False))
    with pytest.raises(ChatTemplateError, match=r"no chat template.*plain string prompt"):
        model.generate(HELLO, GenerationOptions(max_tokens=2))
    with pytest.raises(ChatTemplateError):
        model.stream(HELLO)
    done = model.generate("Hello", GenerationOptions(max_tokens=2))
    assert done.usage.completion_tokens == 2


def _with_template(ckpt: Path, template: str):
    (ckpt / "chat_template.jinja").write_text(template)
    return load(ckpt)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}x",
        "{{ messages[0].update({'content': 'pwned'}) }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_unsafe_template_is_stopped_by_the_sandbox(ckpt: Path, template: str) -> None:
    model = _with_template(ckpt, template)
    with pytest.raises(ChatTemplateError, match=r"unsafe operation: access to attribute '.*' of"):
        model.encode(HELLO)


def test_template_raise_exception(ckpt: Path) -> None:
    model = _with_template(
        ckpt,
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversations must start with a system message') }}{% endif %}ok",
    )
    with pytest.raises(
        ChatTemplateError, match=r"refused the conversation: Conversations must start"
    ):
        model.generate(HELLO, GenerationOptions(max_tokens=1))
    system = Chat(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}))
    assert model.encode(system) == model.tokenizer.encode("ok", add_special_tokens=False)


def test_template_syntax_error(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match=r"does not parse"):
        load(ckpt)


def test_template_runtime_error(ckpt: Path) -> None:
    model = _with_template(ckpt, "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match=r"rendering the chat template failed"):
        model.encode(HELLO)


def test_non_text_content_part(tiny) -> None:
    chat = Chat(({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},))  # type: ignore[typeddict-item]
    with pytest.raises(ChatTemplateError, match=r"text only"):
        tiny.encode(chat)


# -- generation options and context ---------------------------------------------------------------


def test_prompt_longer_than_the_context(tiny) -> None:
    long = "The quick brown fox jumps over the lazy dog. " * 40
    n = len(tiny.encode(long))
    assert n > 100
    with pytest.raises(
        ContextLengthError, match=f"the prompt has {n} tokens but the context holds 100"
    ) as info:
        tiny.generate(long, GenerationOptions(context_limit=100, max_tokens=1))
    assert "context_limit" in str(info.value)
    # The model's own limit (256 positions) applies without the option too.
    with pytest.raises(ContextLengthError, match=r"holds 256") as full:
        tiny.generate(long * 2, GenerationOptions(max_tokens=1))
    # at the model's own limit there is nothing to raise: the message says so
    assert "context_limit" not in str(full.value)
    assert "256 tokens is the most this model takes" in str(full.value)
    # Errors come at the call, before any piece is produced.
    with pytest.raises(ContextLengthError):
        tiny.stream(long, GenerationOptions(context_limit=100))


def test_context_fills_up_with_length(tiny) -> None:
    prompt = tiny.encode("Hello, world!")
    done = tiny.generate("Hello, world!", GenerationOptions(context_limit=len(prompt) + 3))
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (GenerationOptions(temperature=-0.5), "temperature must be >= 0"),
        (GenerationOptions(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (GenerationOptions(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (GenerationOptions(top_k=-1), "top_k must be >= 0"),
        (GenerationOptions(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (GenerationOptions(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (GenerationOptions(max_tokens=-1), "max_tokens must be between 0 and 256"),
        (GenerationOptions(context_limit=0), "context_limit must be > 0"),
        (
            GenerationOptions(logit_bias={10_000: 5.0}),
            "logit_bias names token 10000, outside 0..319",
        ),
        (GenerationOptions(logit_bias={-1: 5.0}), "logit_bias names token -1"),
        (GenerationOptions(max_tokens=0, temperature=-1.0), "temperature must be >= 0"),
    ],
)
def test_bad_options(tiny, options: GenerationOptions, message: str) -> None:
    with pytest.raises(InvalidOptionsError, match=message):
        tiny.generate("Hello", options)
    with pytest.raises(InvalidOptionsError, match=message):
        tiny.stream("Hello", options)  # raised at the call, not at the first next()
    # InvalidOptionsError is also a ValueError for callers that catch that.
    with pytest.raises(ValueError):
        tiny.generate("Hello", options)


def test_empty_prompt(tiny) -> None:
    with pytest.raises(InvalidOptionsError, match=r"prompt is empty"):
        tiny.generate("", GenerationOptions(max_tokens=1))


def test_all_errors_share_a_base() -> None:
    for error in (
        ChatTemplateError,
        CheckpointError,
        ContextLengthError,
        InvalidOptionsError,
        ModelNotFoundError,
        TokenizerError,
        UnsupportedModelError,
    ):
        assert issubclass(error, OmniaError)


def test_continuing_a_final_message_the_template_rewrites(ckpt: Path) -> None:
    model = _with_template(
        ckpt, "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}"
    )
    prefill = Chat(({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}),
                   continue_final=True)
    with pytest.raises(ChatTemplateError, match=r"does not echo the final assistant message"):
        model.encode(prefill)
    # Trimmed by the template (as Llama 3's trims every message): continued after its stripped text.
    model = _with_template(ckpt, "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}|{% endfor %}")
    padded = Chat(({"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Well "}),
                  continue_final=True)
    assert model.tokenizer.decode(model.encode(padded)) == "<user>Hi|<assistant>Well"


def test_only_a_final_assistant_message_can_be_continued(tiny) -> None:
    with pytest.raises(ChatTemplateError, match=r"only a final assistant message"):
        tiny.encode(Chat(HELLO.messages, continue_final=True))
    # An empty final assistant message is the plain generation prompt after the others.
    empty = Chat((*HELLO.messages, {"role": "assistant", "content": ""}), continue_final=True)
    assert tiny.encode(empty) == tiny.encode(HELLO)
