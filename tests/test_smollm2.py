"""Parity with transformers on the embedded SmolLM2-135M-Instruct GGUF.

transformers reads the same GGUF file (`from_pretrained(dir, gguf_file=name)`), dequantizes its
Q4_1 tensors to float32 with the `gguf` package, and rebuilds the tokenizer from the same
tokenizer.ggml.* metadata. Our engine loads the file through MLX and, on the CPU, expands the
quantized tensors to float32 as well, so both sides run float32 math on bit-identical weights
(`test_dequantized_weights_are_identical` checks that) and differ only in the order of floating
point operations (BLAS blocking, attention kernels, rope arithmetic).

Tolerance for full-prompt logits (`LOGITS_ATOL`), measured on this machine: the max
|ours - transformers| over every position and vocabulary entry was 9.7e-5 to 1.2e-4 for the five
chats below (32-78 tokens), 1.3e-4 / 1.4e-4 / 2.3e-4 for 167- / 213- / 397-token prompts (mean
~2e-5 throughout; the test checks the 37-token chat and the 167-token prompt), on logits whose magnitude reaches ~44: a few float32 ulps accumulated through 30
layers, growing slowly with length. We allow 1e-3, about 4x the worst spread seen, yet 100x below
the 0.1 error the loader had while it dequantized with float16 group scales (GGUF stores Q4_1
scales and mins in float16, and MLX expanded the weights in float16), so the test still catches a
precision regression of that kind. Greedy answers must agree token for token.

transformers' model is loaded once per module (~15 s). The file takes ~2 minutes on two idle CPU
cores, most of it in our prefill: MLX's CPU matmul (0.32, Linux) runs far below numpy's BLAS.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import Chat, ChatMessage, GenerationOptions, Model
from mlx_omnia.engine.core.mxcompat import flat_parameters
from mlx_omnia.engine.loading.resolve import default_model_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-3
GREEDY_PREFIX = 16  # tokens that must agree exactly
NEW_TOKENS = 18

CHATS: dict[str, tuple[ChatMessage, ...]] = {
    "capital": ({"role": "user", "content": "What is the capital of France?"},),
    "system": (
        {"role": "system", "content": "You are a pirate. Answer every question like a pirate."},
        {"role": "user", "content": "How do I bake bread?"},
    ),
    "multi-turn": (
        {"role": "user", "content": "My name is Ada and I like numbers."},
        {"role": "assistant", "content": "Nice to meet you, Ada! Numbers are fascinating."},
        {"role": "user", "content": "What is my name, and what is 12 + 30?"},
    ),
    "code": ({"role": "user", "content": "Write a Python function that returns the square of x."},),
    "unicode": (
        {"role": "user", "content": "Translate 'good morning' into French and Japanese (日本語)."},
    ),
}

RAW_TEXTS = [
    "",
    "Hello, world!",
    "1234567890 and 3.14159e-10, ２０２４ (full-width)",
    "naïve café, Ünïcödé ß ﬁ, e\u0301, привет мир, مرحبا, 日本語のテキスト, 🙂👍🏽",
    "def f(x):\n\treturn {'a': [x**2, 2]}  # comment\n",
    "if(a&&b||c){x+=1;}",
    "   leading, trailing   \n\n\n  and    runs\r\n\t\tof whitespace  ",
    "I'm sure you're right, they'll see it's what we've said. HELLO'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start <|im_end| im_start|>",
    "<filename>main.py<file_sep>",
    "https://example.com/a?b=c&d=e#frag",
    "zero\u200bwidth and\u00a0nbsp",
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Any) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Any) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model


def _messages(chat: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [dict(m) for m in chat]


def hf_chat_ids(tok: Any, chat: Sequence[ChatMessage]) -> list[int]:
    out = tok.apply_chat_template(_messages(chat), add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):
        out = cast(Mapping[str, Any], out)["input_ids"]
    return [int(i) for i in out]


def hf_greedy(model: Any, tok: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
    return [int(i) for i in out[0][len(prompt) :]]


def hf_logits(model: Any, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_prompt_ids_match(smollm2: Model, hf_tokenizer: Any, name: str) -> None:
    chat = CHATS[name]
    ours = smollm2.encode(Chat(chat))
    assert ours == hf_chat_ids(hf_tokenizer, chat)
    # The template's own text, too (system default inserted, turns closed with <|im_end|>).
    rendered = hf_tokenizer.apply_chat_template(
        _messages(chat), add_generation_prompt=True, tokenize=False
    )
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == rendered


PREFILLS = {
    "capital": "The capital of France is",
    "multi-turn": "Your name is Ada, and 12 + 30",
    "unicode": "Bonjour ! En japonais : おは",
}


@pytest.mark.parametrize("name", list(PREFILLS))
def test_continued_final_message_ids_match(smollm2: Model, hf_tokenizer: Any, name: str) -> None:
    """A prefill (Chat.continue_final) renders as transformers' continue_final_message does,
    and the greedy answer goes on from its text."""
    chat = (*CHATS[name], cast(ChatMessage, {"role": "assistant", "content": PREFILLS[name]}))
    ours = smollm2.encode(Chat(chat, continue_final=True))
    theirs = hf_tokenizer.apply_chat_template(
        _messages(chat), continue_final_message=True, tokenize=True
    )
    if isinstance(theirs, Mapping):
        theirs = cast(Mapping[str, Any], theirs)["input_ids"]
    assert ours == [int(i) for i in theirs]
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False).endswith(PREFILLS[name])
    options = GenerationOptions(temperature=0, max_tokens=8)
    text = smollm2.tokenizer.decode(ours, skip_special_tokens=False)
    assert (
        smollm2.generate(Chat(chat, continue_final=True), options).text
        == smollm2.generate(text, options).text
    )


def test_raw_text_encodes_match(smollm2: Model, hf_tokenizer: Any) -> None:
    for text in RAW_TEXTS:
        ours = smollm2.encode(text)
        theirs = [int(i) for i in hf_tokenizer(text)["input_ids"]]
        assert ours == theirs, text
        assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(
            theirs, skip_special_tokens=False
        ), text
        assert smollm2.tokenizer.decode(ours) == hf_tokenizer.decode(
            theirs, skip_special_tokens=True
        ), text


def test_special_token_ids_match(smollm2: Model, hf_tokenizer: Any, hf_model: Any) -> None:
    tok = smollm2.tokenizer
    assert (
        tok.eos_token_ids
        == {hf_tokenizer.eos_token_id}
        == {hf_model.generation_config.eos_token_id}
    )
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.vocab_size == len(hf_tokenizer) == smollm2.config["vocab_size"]
    # tokenizer.ggml.add_bos_token is false: neither side prepends <|im_start|> to raw text.
    assert smollm2.encode("Hi")[0] != tok.bos_token_id


def test_dequantized_weights_are_identical(smollm2: Model, hf_model: Any) -> None:
    """Same Q4_1 bytes, expanded to float32 by MLX (ours) and by gguf-py (transformers)."""
    ours = flat_parameters(smollm2.network)
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    tied = {"lm_head.weight"} if smollm2.config["tie_word_embeddings"] else set[str]()
    assert set(theirs) - tied == set(ours)
    for name, value in ours.items():
        assert value.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(value), theirs[name], err_msg=name)


@pytest.mark.parametrize("name", list(CHATS))
def test_greedy_answers_match(smollm2: Model, hf_model: Any, hf_tokenizer: Any, name: str) -> None:
    chat = CHATS[name]
    prompt = hf_chat_ids(hf_tokenizer, chat)
    theirs = hf_greedy(hf_model, hf_tokenizer, prompt, NEW_TOKENS)
    done = smollm2.generate(Chat(chat), GenerationOptions(max_tokens=NEW_TOKENS, temperature=0.0))
    ours = list(done.token_ids)
    # Equal up to GREEDY_PREFIX tokens (or wholly, when an answer ends sooner at <|im_end|>).
    assert ours[:GREEDY_PREFIX] == theirs[:GREEDY_PREFIX], (
        f"ours: {smollm2.tokenizer.decode(ours)!r}\n"
        f"theirs: {hf_tokenizer.decode(theirs, skip_special_tokens=True)!r}"
    )
    if ours == theirs:
        # An answer cut inside a character ends at the last whole one (transformers shows U+FFFD).
        theirs_text = hf_tokenizer.decode(theirs, skip_special_tokens=True)
        assert done.text == theirs_text.rstrip("\ufffd")
        assert done.finish_reason == (
            "stop" if theirs[-1] == hf_tokenizer.eos_token_id else "length"
        )


def _long_prompt(smollm2: Model) -> list[int]:
    story = (
        "Once upon a time, in a village between two rivers, there lived a clockmaker who "
        "repaired every clock but his own. Children brought him broken toys, 3 or 4 a day, and "
        "he fixed them for free. "
    )
    chat: tuple[ChatMessage, ...] = (
        {"role": "system", "content": "You summarize stories in one sentence."},
        {"role": "user", "content": story * 3 + "\nSummarize the story."},
    )
    return smollm2.encode(Chat(chat))


def test_full_prompt_logits_match(smollm2: Model, hf_model: Any) -> None:
    prompts = [smollm2.encode(Chat(CHATS["capital"])), _long_prompt(smollm2)]
    assert len(prompts[-1]) > 150
    for prompt in prompts:
        ours = np.array(smollm2.logits(prompt))
        theirs = hf_logits(hf_model, prompt)
        assert ours.shape == theirs.shape == (len(prompt), smollm2.config["vocab_size"])
        diff = np.abs(ours - theirs)
        assert diff.max() <= LOGITS_ATOL, f"max |diff| {diff.max():.3g} over {len(prompt)} tokens"
        # Next-token choice agrees wherever transformers' top two are not a near tie.
        top2 = np.partition(theirs, -2, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 10 * LOGITS_ATOL
        assert (ours.argmax(-1)[clear] == theirs.argmax(-1)[clear]).all()


def test_quick_start_command() -> None:
    """The README's first command: streams the answer to stdout and exits, every time (it
    exits just after its last matmul, where OpenBLAS 0.3.21's exit-time join hung about one
    run in ten before the engine stopped the workers itself: six runs)."""
    for run in range(6):
        done = subprocess.run(
            [sys.executable, "-m", "mlx_omnia", "What is the capital of France?"],
            capture_output=True,
            text=True,
            timeout=180 if run == 0 else 60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Paris" in done.stdout


def test_readme_python_snippet_prints_each_answer_on_its_own_lines() -> None:
    """README.md's library example, run as written: the streamed answer, then the completion's
    text, then its finish reason and usage, each on lines of their own."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    snippet = next(
        block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if block.startswith("from mlx_omnia import")
    )
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.rstrip("\n").split("\n")
    assert "Paris" in "\n".join(lines[:-2])
    assert re.fullmatch(r"(length|stop) Usage\(.*\)", lines[-1]), lines[-1]
    assert not lines[-2].endswith(("length", "stop")) and "Usage(" not in lines[-2]
