"""Generation mechanics: streaming, finish reasons, usage, stops, UTF-8, sampling options and
checkpoint defaults, on the real SmolLM2-135M-Instruct and the tiny random llama."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_omnia import Chat, Completion, GenerationOptions, InvalidOptionsError, Model, Piece, load
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.generate.stops import StopMatcher
from mlx_omnia.engine.model import GenerationDefaults
from mlx_omnia.engine.text.detokenizer import REPLACEMENT
from tests.fixtures.tiny import write_tiny_llama

FRANCE = Chat(({"role": "user", "content": "What is the capital of France?"},))
GREEDY = GenerationOptions(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Model:
    return load(tiny_llama_dir)


@pytest.fixture(scope="module")
def france(smollm2: Model) -> Completion:
    """SmolLM2's greedy answer: a short sentence that ends with its EOS token."""
    return smollm2.generate(FRANCE, GREEDY)


def _texts(model: Model, ids: tuple[int, ...]) -> list[str]:
    return [model.tokenizer.decode([i]) for i in ids]


# -- streaming, finish reasons and usage ---------------------------------------------------------


def test_eos_finishes_with_stop_and_exact_usage(smollm2: Model, france: Completion) -> None:
    assert "Paris" in france.text
    assert france.finish_reason == "stop"
    assert france.token_ids[-1] in smollm2.tokenizer.eos_token_ids
    assert france.usage.prompt_tokens == len(smollm2.encode(FRANCE))
    assert france.usage.completion_tokens == len(france.token_ids)
    assert france.usage.total_tokens == france.usage.prompt_tokens + france.usage.completion_tokens
    assert "<|im_end|>" not in france.text


def test_stream_concatenates_to_generate(smollm2: Model, france: Completion) -> None:
    pieces = list(smollm2.stream(FRANCE, GREEDY))
    assert all(isinstance(p, Piece) for p in pieces)
    assert "".join(p.text for p in pieces) == france.text
    assert tuple(t for p in pieces for t in p.token_ids) == france.token_ids
    assert all(p.finish_reason is None and p.usage is None for p in pieces[:-1])
    last = pieces[-1]
    assert last.finish_reason == "stop" and last.usage == france.usage
    assert len(pieces) > 3  # streamed token by token, not in one lump


def test_max_tokens_finishes_with_length(smollm2: Model, france: Completion) -> None:
    done = smollm2.generate(FRANCE, GenerationOptions(max_tokens=3, temperature=0.0))
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 3
    assert done.token_ids == france.token_ids[:3]
    assert done.text == smollm2.tokenizer.decode(france.token_ids[:3])


def test_max_tokens_on_raw_text(tiny: Model) -> None:
    for n in (1, 5):
        pieces = list(tiny.stream("Hello, world!", GenerationOptions(max_tokens=n)))
        usage = pieces[-1].usage
        assert usage is not None and pieces[-1].finish_reason == "length"
        assert usage.completion_tokens == n == sum(len(p.token_ids) for p in pieces)
        assert usage.prompt_tokens == len(tiny.encode("Hello, world!"))
    zero = tiny.generate("Hello", GenerationOptions(max_tokens=0))
    assert zero.finish_reason == "length" and zero.token_ids == () and zero.text == ""


def test_checkpoint_max_new_tokens_and_context_bound_generation(tiny: Model) -> None:
    # No max_tokens: the context (256 positions) bounds the generation.
    prompt = tiny.encode("Hello")
    done = tiny.generate("Hello", GenerationOptions(context_limit=len(prompt) + 4))
    assert done.finish_reason == "length" and done.usage.completion_tokens == 4


def test_max_tokens_is_at_most_the_context_and_clamped_after_the_prompt(tiny: Model) -> None:
    context = tiny.signature.context_length
    with pytest.raises(InvalidOptionsError, match=f"at most {context} .the model's context length"):
        tiny.stream("Hello", GenerationOptions(max_tokens=context + 1))
    # Up to the context, it is taken: the answer stops when the context is full.
    prompt = tiny.encode("Hello")
    done = tiny.generate("Hello", GenerationOptions(max_tokens=context, context_limit=len(prompt) + 3))
    assert done.finish_reason == "length" and done.usage.completion_tokens == 3


# -- stop strings and stop tokens ----------------------------------------------------------------


def _boundary_stop(model: Model, answer: Completion, i: int) -> tuple[str, str]:
    """A stop string spanning the boundary between tokens i and i+1 of `answer`, and the text
    expected before it."""
    texts = _texts(model, answer.token_ids)
    left, right = texts[i], texts[i + 1]
    assert len(left) >= 2 and len(right) >= 2, texts
    stop = left[-2:] + right[:2]
    boundary = len("".join(texts[: i + 1]))
    assert answer.text.find(stop) == boundary - 2, (answer.text, stop)
    return stop, answer.text[: boundary - 2]


def test_stop_string_across_a_token_boundary(smollm2: Model, france: Completion) -> None:
    stop, before = _boundary_stop(smollm2, france, 2)
    options = GenerationOptions(max_tokens=16, temperature=0.0, stop=[stop])
    pieces = list(smollm2.stream(FRANCE, options))
    text = "".join(p.text for p in pieces)
    assert text == before
    assert stop not in text and all(stop not in p.text for p in pieces)
    assert pieces[-1].finish_reason == "stop"
    usage = pieces[-1].usage
    assert usage is not None and usage.completion_tokens == 4  # the token completing the stop


def test_several_stop_strings_cut_at_the_earliest(smollm2: Model, france: Completion) -> None:
    early, before = _boundary_stop(smollm2, france, 1)
    late, _ = _boundary_stop(smollm2, france, 3)
    options = GenerationOptions(max_tokens=16, temperature=0.0, stop=["never-there", late, early])
    done = smollm2.generate(FRANCE, options)
    assert done.text == before and done.finish_reason == "stop"
    assert early not in done.text and late not in done.text


def test_stops_completed_by_one_token_cut_at_the_earliest_start(
    smollm2: Model, france: Completion
) -> None:
    """Token 1's text (" capital" after "The") completes four stops at once: one began in the
    text held back from token 0, the others (overlapping, one a prefix of another) lie inside
    the token. The cut is at the earliest start, whichever stop is listed first."""
    texts = _texts(smollm2, france.token_ids)
    start, word = len(texts[0]), texts[1]
    assert len(word) >= 5, texts
    spanning, inside, overlapping, prefix = texts[0][-1] + word[:2], word[1:4], word[3:5], word[1:3]
    for stop, at in [(spanning, start - 1), (inside, start + 1), (overlapping, start + 3)]:
        assert france.text.find(stop) == at, (france.text, stop)
    stops = ["never-there", overlapping, spanning, inside, prefix]
    pieces = list(smollm2.stream(FRANCE, GenerationOptions(max_tokens=16, stop=stops)))
    assert "".join(p.text for p in pieces) == france.text[: start - 1]
    last = pieces[-1]
    assert last.finish_reason == "stop" and last.stop_sequence == spanning
    assert last.usage is not None and last.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("stops", "chunks", "before", "matched"),
    [
        # one chunk completes both; the later-listed starts earlier
        (["world", "lo w"], ["hello world!"], "hel", "lo w"),
        # overlapping, the middle-listed starts first (though "cd" ends first)
        (["def", "bcde", "cd"], ["abcdefg"], "a", "bcde"),
        # a stop that ends another, listed first
        (["c", "abc"], ["xxabc"], "xx", "abc"),
        (["c", "abc"], ["xxa", "b", "c"], "xx", "abc"),
        # the earliest began in the text held back from the previous chunk
        (["rld", "o w"], ["hello", " world"], "hell", "o w"),
        # a stop that begins another: same start, the shorter is the one completed first
        (["abcd", "ab"], ["xabcd"], "x", "ab"),
        (["abcd", "ab"], ["xa", "bcd"], "x", "ab"),
    ],
    ids=["later-listed", "overlapping", "suffix", "suffix-streamed", "held", "prefix",
         "prefix-streamed"],
)
def test_stop_matcher_cuts_at_the_earliest_start(
    stops: list[str], chunks: list[str], before: str, matched: str
) -> None:
    matcher = StopMatcher(stops)
    emitted = ""
    for n, chunk in enumerate(chunks, 1):
        text, hit = matcher.feed(chunk)
        emitted += text
        assert hit == (n == len(chunks)), (chunk, emitted)
    assert emitted == before and matcher.matched == matched


def test_stop_token_ids(smollm2: Model, france: Completion) -> None:
    stop_id = france.token_ids[3]
    assert stop_id not in france.token_ids[:3]
    done = smollm2.generate(FRANCE, GenerationOptions(max_tokens=16, stop_token_ids=[stop_id]))
    assert done.finish_reason == "stop"
    assert done.token_ids == france.token_ids[:4]
    assert done.usage.completion_tokens == 4
    assert done.text == smollm2.tokenizer.decode(france.token_ids[:3])


# -- UTF-8: pieces are whole characters ----------------------------------------------------------

UNICODE_TEXTS = [
    "東京🙂café",
    "naïve — 日本語のテキスト 👍🏽 Ελληνικά",
    "🙂🙂🙂 emoji in a row 🇫🇷🇯🇵 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Ünïcödé ∑∫√ ≠ ≤ ½ ¾ — “quotes” ‘and’ …",
]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_incremental_decoder_emits_whole_characters(smollm2: Model, text: str) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    # Some tokens hold only part of a character's bytes: the case that matters.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    decoder = tok.incremental_decoder()
    pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == text == tok.decode(ids)
    assert sum(1 for p in pieces if p) > 3


def test_incremental_decoder_drops_an_incomplete_character(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("ab🙂", add_special_tokens=False)
    partial = next(j for j in range(len(ids)) if tok.decode(ids[: j + 1]).endswith(REPLACEMENT))
    decoder = tok.incremental_decoder()
    out = [decoder.add(i) for i in ids[: partial + 1]]
    assert REPLACEMENT not in "".join(out)
    rest = decoder.flush()  # cut short: the text stops at the last whole character
    assert REPLACEMENT not in rest
    assert "".join(out) + rest == "ab"


class Scripted(nn.Module):
    """A network that emits a fixed token sequence (then `last` forever), whatever it is fed."""

    def __init__(self, script: list[int], vocab: int, last: int) -> None:
        super().__init__()
        self._script, self._vocab, self._last = script, vocab, last
        self._step = 0

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        token = self._script[self._step] if self._step < len(self._script) else self._last
        self._step += 1
        row = mx.zeros((self._vocab,)).at[token].add(1.0)
        return mx.broadcast_to(row, (1, 1 if last_only else ids.shape[1], self._vocab))

    def make_cache(self) -> list[KVCache]:
        self._step = 0
        return [KVCache()]


def _scripted(smollm2: Model, text: str) -> Model:
    tok = smollm2.tokenizer
    eos = min(tok.eos_token_ids)
    return Model(
        name="scripted",
        network=Scripted(tok.encode(text, add_special_tokens=False), tok.vocab_size, eos),
        tokenizer=tok,
        config={"vocab_size": tok.vocab_size},
        context_length=512,
        defaults=GenerationDefaults(),
        source="",
    )


def _metaspace_model(answer: list[str]) -> Model:
    """A scripted model whose tokenizer is SentencePiece-shaped (Metaspace: a word's leading
    space is "▁", and decoding drops the space before a text's first word), answering `answer`
    (tokens) then </s>, with a ChatML-like template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from mlx_omnia.engine.text.tokenizer import Tokenizer

    words = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁Q", ":", "▁A", "<0xE6>"]
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.add_special_tokens(["</s>"])
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
    tok = Tokenizer(hf, eos_token="</s>", chat_template=template)
    return Model(
        name="metaspace",
        network=Scripted([vocab[w] for w in answer], len(vocab), vocab["</s>"]),
        tokenizer=tok,
        config={"vocab_size": len(vocab)},
        context_length=64,
        defaults=GenerationDefaults(),
        source="",
    )


def test_a_continued_text_keeps_the_space_before_its_next_word() -> None:
    """A raw prompt or a prefill goes on mid-text: " Paris" after "The capital of France is",
    not "Paris" (a Metaspace decoder drops a text's leading space, right for an answer that
    starts a turn)."""
    model = _metaspace_model(["▁Paris", "."])
    assert model.generate("The capital of France is").text == " Paris."
    question = {"role": "user", "content": "Q: The capital of France"}
    prefill = Chat((question, {"role": "assistant", "content": "The capital is"}), continue_final=True)
    assert model.generate(prefill).text == " Paris."
    # A new assistant turn starts its text: no leading space, as decoding the answer alone.
    assert model.generate(Chat((question,))).text == "Paris."
    assert "".join(p.text for p in model.stream("The capital of France is")) == " Paris."


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_streamed_pieces_are_whole_characters(smollm2: Model, text: str) -> None:
    model = _scripted(smollm2, text)
    pieces = list(model.stream("Hi", GenerationOptions(max_tokens=64)))
    assert all(REPLACEMENT not in p.text for p in pieces), [p.text for p in pieces]
    assert "".join(p.text for p in pieces) == text
    assert pieces[-1].finish_reason == "stop"
    assert (
        sum(len(p.token_ids) for p in pieces)
        == len(smollm2.tokenizer.encode(text, add_special_tokens=False)) + 1
    )


def test_stop_string_through_multibyte_characters(smollm2: Model) -> None:
    model = _scripted(smollm2, "東京🙂café and more")
    for stop, before in [("🙂c", "東京"), ("京🙂", "東"), ("é a", "東京🙂caf")]:
        pieces = list(model.stream("Hi", GenerationOptions(max_tokens=64, stop=[stop])))
        assert "".join(p.text for p in pieces) == before
        assert all(REPLACEMENT not in p.text and stop not in p.text for p in pieces)
        assert pieces[-1].finish_reason == "stop"


# -- sampling options ----------------------------------------------------------------------------


def test_seed_reproduces_a_sampled_sequence(tiny: Model) -> None:
    def sample(seed: int) -> tuple[int, ...]:
        return tiny.generate(
            "Hello", GenerationOptions(max_tokens=12, temperature=1.0, seed=seed)
        ).token_ids

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first
    greedy = tiny.generate("Hello", GenerationOptions(max_tokens=12, temperature=0.0)).token_ids
    assert first != greedy


def test_top_k_1_equals_greedy(tiny: Model) -> None:
    greedy = tiny.generate("Hello", GenerationOptions(max_tokens=10, temperature=0.0)).token_ids
    for seed in (0, 1):
        top1 = tiny.generate(
            "Hello", GenerationOptions(max_tokens=10, temperature=1.5, top_k=1, seed=seed)
        )
        assert top1.token_ids == greedy


def test_logit_bias_forces_and_bans_tokens(tiny: Model) -> None:
    forced = tiny.generate("Hello", GenerationOptions(max_tokens=6, logit_bias={42: 100.0}))
    assert forced.token_ids == (42,) * 6
    sampled = tiny.generate(
        "Hello", GenerationOptions(max_tokens=6, temperature=1.0, seed=0, logit_bias={42: 100.0})
    )
    assert sampled.token_ids == (42,) * 6
    greedy = tiny.generate("Hello", GenerationOptions(max_tokens=8)).token_ids
    banned = set(greedy[:2])
    out = tiny.generate(
        "Hello", GenerationOptions(max_tokens=8, logit_bias={t: -100.0 for t in banned})
    )
    assert not banned & set(out.token_ids)


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
    ],
)
def test_penalties_change_greedy_output(tiny: Model, penalty: dict[str, float]) -> None:
    plain = tiny.generate("Hello", GenerationOptions(max_tokens=12)).token_ids
    assert len(set(plain)) < len(plain)  # the random model repeats itself greedily
    penalized = tiny.generate("Hello", GenerationOptions(max_tokens=12, **penalty)).token_ids
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


# -- inputs --------------------------------------------------------------------------------------


def _hf_style_checkpoint(
    tiny_llama_dir: Path, dst: Path, *, bos_post_processor: bool, add_bos: bool | None
) -> Path:
    from tokenizers import Tokenizer, processors

    shutil.copytree(tiny_llama_dir, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    config.pop("add_bos_token")
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if bos_post_processor:
        tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|endoftext|> $A",
                    pair="<|endoftext|> $A <|endoftext|> $B",
                    special_tokens=[("<|endoftext|>", 0)],
                ),
            ]
        )
        tok.save(str(dst / "tokenizer.json"))
    return dst


@pytest.mark.parametrize(
    ("bos_post_processor", "add_bos"),
    [(False, None), (False, True), (True, None), (True, False), (True, True)],
)
def test_raw_text_is_tokenized_as_hf_does(
    tiny_llama_dir: Path, tmp_path: Path, bos_post_processor: bool, add_bos: bool | None
) -> None:
    """transformers 5: tokenizer.json's post-processor decides the BOS, add_bos_token does not."""
    transformers = pytest.importorskip("transformers")
    path = _hf_style_checkpoint(
        tiny_llama_dir, tmp_path / "ckpt", bos_post_processor=bos_post_processor, add_bos=add_bos
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    model = load(path)
    for text in ["Hello, world!", "<|endoftext|>Hello", " leading space", "東京🙂café", ""]:
        assert model.encode(text) == hf(text)["input_ids"], text
    if bos_post_processor:
        assert model.encode("Hello")[0] == 0
        assert model.generate("Hello", GenerationOptions(max_tokens=1)).usage.prompt_tokens == len(
            hf("Hello")["input_ids"]
        )


def test_smollm2_raw_text_has_no_bos(smollm2: Model) -> None:
    ids = smollm2.encode("Hello world")
    assert smollm2.tokenizer.bos_token_id not in ids
    assert smollm2.tokenizer.decode(ids) == "Hello world"


def test_chat_with_text_parts(tiny: Model) -> None:
    parts = Chat(
        (
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
            },
        )
    )
    plain = Chat(
        (
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello\nworld"},
        )
    )
    assert tiny.encode(parts) == tiny.encode(plain)
    done = tiny.generate(parts, GenerationOptions(max_tokens=3))
    assert done.usage.prompt_tokens == len(tiny.encode(plain))
    assert done.token_ids == tiny.generate(plain, GenerationOptions(max_tokens=3)).token_ids


def test_chat_usage_counts_the_rendered_prompt(tiny: Model) -> None:
    chat = Chat(({"role": "user", "content": "What is the capital of France?"},))
    rendered = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.encode(chat) == tiny.tokenizer.encode(rendered, add_special_tokens=False)
    done = tiny.generate(chat, GenerationOptions(max_tokens=2))
    assert done.usage.prompt_tokens == len(tiny.encode(chat))


# -- checkpoint defaults (generation_config.json) ------------------------------------------------


def _with_generation_config(tmp_path: Path, name: str, config: dict[str, object]) -> Model:
    path = write_tiny_llama(tmp_path / name)
    (path / "generation_config.json").write_text(json.dumps(config))
    return load(path)


def test_generation_config_defaults_apply(tiny: Model, tmp_path: Path) -> None:
    sampled = _with_generation_config(
        tmp_path,
        "sampled",
        {
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "repetition_penalty": 1.3,
            "max_new_tokens": 7,
            "eos_token_id": 2,
        },
    )
    explicit = GenerationOptions(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.3, seed=5
    )
    by_default = sampled.generate("Hello", GenerationOptions(seed=5))
    assert by_default.usage.completion_tokens == 7 and by_default.finish_reason == "length"
    assert by_default.token_ids == tiny.generate("Hello", explicit).token_ids
    # An explicit option wins over the checkpoint's default.
    greedy = sampled.generate("Hello", GenerationOptions(temperature=0.0, max_tokens=5))
    assert (
        greedy.token_ids
        == tiny.generate(
            "Hello", GenerationOptions(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
        ).token_ids
    )


def test_generation_config_without_do_sample_is_greedy(tiny: Model, tmp_path: Path) -> None:
    model = _with_generation_config(
        tmp_path, "greedy", {"do_sample": False, "temperature": 0.9, "top_k": 3, "eos_token_id": 2}
    )
    expected = tiny.generate("Hello", GenerationOptions(max_tokens=8, temperature=0.0)).token_ids
    for seed in (0, 1):
        assert (
            model.generate("Hello", GenerationOptions(max_tokens=8, seed=seed)).token_ids
            == expected
        )


def test_generation_config_eos_ids_stop(tiny: Model, tmp_path: Path) -> None:
    first = tiny.generate("Hello", GenerationOptions(max_tokens=4)).token_ids
    model = _with_generation_config(tmp_path, "eos", {"eos_token_id": [2, first[2]]})
    done = model.generate("Hello", GenerationOptions(max_tokens=8))
    assert done.finish_reason == "stop"
    assert done.token_ids == first[:3]


# -- log-probabilities -------------------------------------------------------------------------
def test_logprobs_are_the_models_whatever_the_sampling(smollm2: Model) -> None:
    """GenerationOptions.logprobs: each token's log-softmax under the model (not under the
    temperature or penalties that chose it), with the likeliest alternatives best first."""
    prompt = "The capital of France is"
    options = GenerationOptions(
        temperature=1.5, top_k=5, seed=7, max_tokens=6, presence_penalty=1.0, logprobs=4
    )
    done = smollm2.generate(prompt, options)
    assert [e.token_id for e in done.logprobs] == [
        t for t in done.token_ids if t not in smollm2.tokenizer.eos_token_ids
    ]
    assert b"".join(e.token_bytes for e in done.logprobs).decode() == done.text
    ids = smollm2.encode(prompt)
    answer = [e.token_id for e in done.logprobs]
    logits = smollm2.logits(ids + answer[:-1])[len(ids) - 1 :]
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, entry in enumerate(done.logprobs):
        assert abs(entry.logprob - rows[i, entry.token_id].item()) < 1e-3
        assert len(entry.top) == 4
        best = mx.argsort(-rows[i])[:4].tolist()
        assert [t.token_id for t in entry.top] == best
        assert all(abs(t.logprob - rows[i, t.token_id].item()) < 1e-3 for t in entry.top)
        assert all(t.token_bytes == smollm2.tokenizer.token_bytes(t.token_id) for t in entry.top)
    # The same seed samples the same tokens with or without logprobs.
    plain = smollm2.generate(prompt, GenerationOptions(
        temperature=1.5, top_k=5, seed=7, max_tokens=6, presence_penalty=1.0
    ))
    assert plain.token_ids == done.token_ids and plain.logprobs == ()
    pieces = list(smollm2.stream(prompt, options))
    assert tuple(e for p in pieces for e in p.logprobs) == done.logprobs


@pytest.mark.parametrize("n", [-1, 21])
def test_logprobs_out_of_range(smollm2: Model, n: int) -> None:
    with pytest.raises(InvalidOptionsError, match="logprobs must be between 0 and 20"):
        smollm2.generate("Hi", GenerationOptions(max_tokens=1, logprobs=n))


def test_token_bytes_of_each_vocabulary_kind(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("ab 日本🙂", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "ab 日本🙂".encode()
    assert any(not _whole(tok.token_bytes(i)) for i in ids)  # a character split across tokens
    eos = min(tok.eos_token_ids)
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()
    meta = _metaspace_model([]).tokenizer
    assert meta.token_bytes(meta.encode("The Paris", add_special_tokens=False)[1]) == b" Paris"
    byte = meta.token_to_id("<0xE6>")
    assert byte is not None and meta.token_bytes(byte) == b"\xe6"  # a byte-fallback piece


def _whole(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True
