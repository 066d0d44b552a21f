"""A `tokenizers` tokenizer rebuilt from GGUF metadata (tokenizer.ggml.*)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlx_omnia.engine.errors import TokenizerError
from mlx_omnia.engine.text.tokenizer import Tokenizer

# llama.cpp token types
CONTROL, USER_DEFINED = 3, 4

# GPT-2's split regex; llama.cpp's "pre" names select the splits that run before it.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact", "falcon"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in ("llama3", "llama-bpe", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), byte_level]
        )
    if pre in ("gpt2", "default", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise TokenizerError(
        f"GGUF tokenizer pre-tokenization {pre!r} is not supported yet; load the HF checkpoint "
        "directory instead"
    )


def _int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        return int(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def _bool(metadata: Mapping[str, Any], key: str) -> bool | None:
    value = metadata.get(key)
    if value is None:
        return None
    return bool(value.item() if hasattr(value, "item") else value)


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    model = str(metadata.get("tokenizer.ggml.model", ""))
    if model != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported yet (only byte-level BPE, 'gpt2'); "
            "load the HF checkpoint directory instead"
        )
    tokens = cast(Sequence[str], metadata.get("tokenizer.ggml.tokens") or [])
    merges = cast(Sequence[str], metadata.get("tokenizer.ggml.merges") or [])
    if not tokens:
        raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens")
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types: list[int] = [int(t) for t in raw_types.tolist()] if raw_types is not None else []
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "gpt2")))
    hf.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tok, special=types[i] == CONTROL, normalized=False)
        for i, tok in enumerate(tokens)
        if i < len(types) and types[i] in (CONTROL, USER_DEFINED)
    ]
    hf.add_special_tokens([t for t in specials if t.special])  # pyright: ignore[reportUnknownMemberType]  # stub: a bare list
    hf.add_tokens([t for t in specials if not t.special])  # pyright: ignore[reportUnknownMemberType]  # stub: a bare list

    def token(key: str) -> str | None:
        i = _int(metadata, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(
        hf,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        add_bos_token=_bool(metadata, "tokenizer.ggml.add_bos_token"),
        add_eos_token=bool(_bool(metadata, "tokenizer.ggml.add_eos_token")),
        chat_template=template if isinstance(template, str) else None,
        extra_special_tokens={
            "unk_token": token("tokenizer.ggml.unknown_token_id"),
            "pad_token": token("tokenizer.ggml.padding_token_id"),
        },
    )
