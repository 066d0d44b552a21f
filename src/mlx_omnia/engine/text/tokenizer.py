"""The checkpoint's tokenizer (HF `tokenizers`), its special tokens and chat template."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from llguidance import LLTokenizer
from tokenizers import Tokenizer as HFTokenizer

from mlx_omnia.engine.errors import ChatTemplateError, TokenizerError
from mlx_omnia.engine.text.chat_template import ChatTemplate
from mlx_omnia.engine.text.detokenizer import IncrementalDecoder
from mlx_omnia.engine.text.reasoning import ReasoningFormat, reasoning_format
from mlx_omnia.engine.text.tools import ToolFormat, tool_format


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = cast(Mapping[str, Any], value).get("content")
        return content if isinstance(content, str) else None
    return None


class Tokenizer:
    """Encodes text and chats, decodes ids, and knows which ids end a generation."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
        extra_special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        eos = list(eos_token_ids)
        if eos_token is not None and (eid := tokenizer.token_to_id(eos_token)) is not None:
            eos.append(eid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        specials: dict[str, str | None] = {"bos_token": bos_token, "eos_token": eos_token}
        specials.update(extra_special_tokens or {})
        self.chat_template = (
            ChatTemplate(chat_template, special_tokens=specials) if chat_template else None
        )
        self._grammar_tokenizers: dict[int, LLTokenizer] = {}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_directory(cls, path: Path, *, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and chat_template.jinja/.json from `path`."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{path} has no tokenizer.json; only checkpoints with a fast (tokenizers) "
                "tokenizer are supported - convert it with transformers' tokenizer.save_pretrained"
            )
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerError(f"{tok_file} could not be read: {e}") from e
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            config = _read_json(config_file)
        template = _chat_template(path, config)
        extra = {
            key: _token_text(config.get(key))
            for key in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
            if key in config
        }
        # As in transformers 5, tokenizer.json's post-processor alone decides which special
        # tokens a raw prompt gets; tokenizer_config's add_bos_token/add_eos_token are not
        # applied on top (they are for GGUF metadata, which has no post-processor).
        return cls(
            hf,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=None,
            add_eos_token=False,
            chat_template=template,
            eos_token_ids=eos_token_ids,
            extra_special_tokens=extra,
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize raw text as HF's `tokenizer(text)` does."""
        # encode_batch, not encode: tokenizers' `encode` keeps the GIL for its whole run (seconds
        # on a prompt of megabytes, while a server's event loop waits), `encode_batch` lets it go.
        ids = list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if add_special_tokens:
            bos = self.bos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
            if self.add_eos_token and eos_id is not None and (not ids or ids[-1] != eos_id):
                ids.append(eos_id)
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render the chat and tokenize it without adding special tokens (the template has them).
        `continue_final`: the prompt ends with the final assistant message's text, which the
        answer continues (ChatTemplate.render_continued)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint's tokenizer has no chat template; pass a plain string prompt, "
                "or add chat_template.jinja to the checkpoint directory"
            )
        extra = dict(variables or {})
        if continue_final:
            text = self.chat_template.render_continued(messages, tools=tools, **extra)
        else:
            text = self.chat_template.render(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra
            )
        return self.encode(text, add_special_tokens=False)

    def decode(
        self, ids: Sequence[int], *, skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> str:
        """The text of `ids`; special tokens are left out (`skip_special_tokens`) except those
        in `keep` (markers a parser reads, such as a tool call's)."""
        if not keep or not skip_special_tokens or keep.isdisjoint(ids):
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in keep:
                parts += [self._tok.decode(run, skip_special_tokens=True), self._tok.id_to_token(i) or ""]
                run = []
            else:
                run.append(i)
        parts.append(self._tok.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def grammar_tokenizer(self, n_vocab: int) -> LLTokenizer:
        """This vocabulary as llguidance sees it (what constraints compile against), for a model
        whose logits have `n_vocab` rows (a checkpoint's vocab_size may pad past the tokenizer's
        tokens) and whose end tokens are `eos_token_ids`. Built once (a fraction of a second for
        a 50k vocabulary) and kept."""
        built = self._grammar_tokenizers.get(n_vocab)
        if built is None:
            eos = sorted(self.eos_token_ids)
            try:
                built = LLTokenizer(self._tok.to_str(), n_vocab=n_vocab, eos_token=eos or None)
            except (ValueError, RuntimeError) as e:
                raise TokenizerError(
                    f"llguidance cannot read this tokenizer, so output cannot be constrained: {e}"
                ) from e
            self._grammar_tokenizers[n_vocab] = built
        return built


    def incremental_decoder(self, keep: frozenset[int] = frozenset()) -> IncrementalDecoder:
        return IncrementalDecoder(lambda ids: self.decode(ids, keep=keep))

    @functools.cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """The reasoning markers this checkpoint's template writes, if any."""
        return reasoning_format(self.chat_template.source if self.chat_template else None)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How this checkpoint's template writes tool calls (the generic form without one)."""
        return tool_format(self.chat_template.source if self.chat_template else None)

    def special_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """The special (added) tokens among `texts`, by text: a marker that is one token."""
        return {t: i for t in texts if t in self._added and (i := self._tok.token_to_id(t)) is not None}

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for within a text (a token's text may be part of a
        character): a byte-level BPE piece through its byte alphabet, a byte-fallback piece
        <0xNN> as its byte, a SentencePiece piece with "▁" as a space, an added token as its
        text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self._added:
            return piece.encode()
        if self._byte_level:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps pieces through the byte-level alphabet (GPT-2's)."""
        return '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))

    @functools.cached_property
    def _added(self) -> frozenset[str]:
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return cast(dict[str, Any], data)


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = path / "chat_template.json"
    if as_json.is_file():
        value = _read_json(as_json).get("chat_template")
        if isinstance(value, str):
            return value
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # A list of named templates: the "default" one serves plain chats.
        for entry in cast(list[Any], value):
            if isinstance(entry, Mapping):
                named = cast(Mapping[str, Any], entry)
                if named.get("name") == "default" and isinstance(named.get("template"), str):
                    return cast(str, named["template"])
    return None
