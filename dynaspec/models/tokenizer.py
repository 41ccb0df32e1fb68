"""Text <-> token ids: a thin layer over a Hugging Face fast tokenizer, plus streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Tokens that close a chat turn in common templates. One of them counts as an end-of-sequence id
# when it is a token of the vocabulary and the chat template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# Prompt tokens kept as context for the first decode, so that a leading space or a byte sequence
# that began in the prompt decodes as it would inside the full text.
_DETOKENIZER_CONTEXT = 6


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template and the ids that end a sequence."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: list[int] | None = None) -> None:
        self._tok = hf_tokenizer
        self._vocab: dict[str, int] | None = None
        ids: list[int] = []
        for token_id in _as_id_list(hf_tokenizer.eos_token_id) + list(extra_eos_token_ids or []):
            if token_id not in ids:
                ids.append(token_id)
        template = self.chat_template or ""
        for token in END_OF_TURN_TOKENS:
            token_id = hf_tokenizer.convert_tokens_to_ids(token)
            known = isinstance(token_id, int) and token_id != hf_tokenizer.unk_token_id
            if token in template and known and token_id not in ids:
                ids.append(token_id)
        self._eos_token_ids = ids

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer files from a Hugging Face directory.

        End-of-sequence ids also come from config.json and generation_config.json when present.
        """
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"{path}: no tokenizer (tokenizer.json / tokenizer_config.json missing)")
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # transformers raises many types for broken files
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: cannot load tokenizer: {first_line}") from None
        extra: list[int] = []
        for name in ("config.json", "generation_config.json"):
            if (path / name).is_file():
                extra += _as_id_list(_read_json(path / name).get("eos_token_id"))
        return cls(hf_tokenizer, extra)

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying transformers tokenizer (for reference comparisons)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens).

        The model's embedding may have more rows (padding); those ids never come out of encode().
        """
        return len(self._tok)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: the tokenizer's eos, the config's and generation config's eos,
        and the chat template's end-of-turn token (e.g. <|im_end|>)."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        return template or None

    def encode(self, text: str) -> list[int]:
        """Token ids of text, with BOS added when this tokenizer adds it by default."""
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens skipped."""
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids for a conversation, ending with the assistant's generation prompt."""
        if self.chat_template is None:
            raise ValueError("model has no chat template")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes BOS itself when the model wants one: do not add special tokens again.
        return list(self._tok.encode(text, add_special_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = self._tok.get_vocab()
        return self._vocab

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether every token string maps to the same id in both (a draft must share the target's)."""
        return self is other or self.get_vocab() == other.get_vocab()


class IncrementalDetokenizer:
    """Turns a stream of generated ids into a stream of text (``tokenizers``' ``DecodeStream``).

    Decoding token by token is wrong in two ways: a character split over several byte tokens
    decodes to U+FFFD until its last byte arrives, and some tokenizers drop or add a leading space
    when a token is decoded alone. The stream starts from the prompt's last tokens as context and
    holds text back while the ids so far end inside a character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.hf_tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids[-_DETOKENIZER_CONTEXT:]), skip_special_tokens=True)
        self._held: list[int] = []  # ids the stream holds back: they end inside a character
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they completed (possibly empty)."""
        new_text = self._stream.step(self._backend, list(new_ids)) if new_ids else None
        if new_text is None:
            self._held.extend(new_ids)
            return ""
        self._held.clear()
        self._text += new_text
        return new_text

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is held back, incomplete characters included."""
        new_text = self._backend.decode(self._held, skip_special_tokens=True) if self._held else ""
        self._held.clear()
        self._text += new_text
        return new_text
