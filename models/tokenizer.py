"""Byte-level tokenizer of the built-in policy: ids 0..255 are raw UTF-8 bytes, control tokens follow from 256.

``encode`` only ever produces byte ids, so text from the outside world (tool output, web pages, user input) cannot
spell a control token: the string "<|end|>" in a tool result stays seven bytes and never closes the observation.
Control tokens enter a sequence only through ``encode_special``, which only the chat format calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
FILE_NAME = "tokenizer.json"
_REPLACEMENT = "\ufffd"


def tokenizer_file(path: str | Path) -> Path:
    """``path`` itself, or ``path/tokenizer.json`` when it is a directory (a checkpoint)."""
    path = Path(path)
    return path / FILE_NAME if path.is_dir() else path


def _utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``; text that cannot be encoded (lone surrogates) degrades instead of raising."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", errors="surrogateescape")  # bytes smuggled in by os/subprocess decoding
        except UnicodeEncodeError:
            return text.encode("utf-8", errors="replace")


class ControlTokens:
    """What the byte and BPE tokenizers share: ``n_text`` ids of text come first, then the control tokens of
    ``SPECIAL_TOKENS``, and the vocabulary is padded to a multiple of 16. Subclasses say which bytes a text id spells."""

    def _init_control_tokens(self, n_text: int) -> None:
        self.n_text = n_text
        self.special: dict[str, int] = {name: n_text + i for i, name in enumerate(SPECIAL_TOKENS)}
        self._names = {i: name for name, i in self.special.items()}
        self.vocab_size = (n_text + len(SPECIAL_TOKENS) + 15) // 16 * 16  # ids past the last control token: padding
        self.pad_id = self.special["<|pad|>"]
        self.bos_id = self.special["<|bos|>"]
        self.eos_id = self.special["<|eos|>"]

    def _text_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.vocab_size

    def id_of(self, name: str) -> int:
        """Id of a control token, e.g. ``id_of("<|end|>")``."""
        try:
            return self.special[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; known: {', '.join(self.special)}") from None

    encode_special = id_of

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: control tokens as their names, unknown ids and broken UTF-8 as U+FFFD. Never raises."""
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            try:
                i = int(i)
            except (TypeError, ValueError, OverflowError):
                i = -1
            if 0 <= i < self.n_text:
                run += self._text_bytes(i)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            parts.append(self._names.get(i, _REPLACEMENT))
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._names


class ByteTokenizer(ControlTokens):
    """256 byte ids, then the control tokens (vocabulary 272: ids 268..271 are unused padding)."""

    n_bytes = 256

    def __init__(self) -> None:
        self._init_control_tokens(self.n_bytes)

    def encode(self, text: str) -> list[int]:
        """Byte ids of ``text``. Never produces a control token, whatever the text says."""
        return list(_utf8(text))

    def _text_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,))

    # A checkpoint directory holds tokenizer.json next to config.json, so it can be loaded without this source tree.
    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON to ``path`` (a file, or a directory that gets ``tokenizer.json``)."""
        path = tokenizer_file(path)
        data = {
            "type": "byte",
            "n_bytes": self.n_bytes,
            "special_tokens": list(SPECIAL_TOKENS),
            "vocab_size": self.vocab_size,
        }
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ByteTokenizer:
        """Read a tokenizer written by ``save`` (a file, or a directory holding ``tokenizer.json``)."""
        path = tokenizer_file(path)
        data = json.loads(path.read_text())
        tok = cls()
        found = (data.get("type"), data.get("n_bytes"), tuple(data.get("special_tokens", ())), data.get("vocab_size"))
        expected = ("byte", tok.n_bytes, SPECIAL_TOKENS, tok.vocab_size)
        if found != expected:
            raise ValueError(
                f"{path} describes a tokenizer {found} that this ByteTokenizer {expected} cannot reproduce; "
                "load the checkpoint with the sandforge version that wrote it"
            )
        return tok
