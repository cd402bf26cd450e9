"""Byte-level BPE tokenizer of the built-in policy: a drop-in for ``ByteTokenizer`` with ~4x shorter sequences.

Ids ``0..n_text-1`` belong to a Hugging Face ``tokenizers`` byte-level BPE model (every byte string is encodable, there
is no unknown token); the control tokens of ``SPECIAL_TOKENS`` follow at ``n_text..n_text+11`` and live only in this
wrapper, never in the HF tokenizer. So, as with ``ByteTokenizer``, ``encode`` cannot produce a control token whatever
the text says ("<|end|>" in a tool result stays ordinary text), and control tokens enter a sequence only via
``encode_special``. ``decode`` maps ids back to their bytes itself, so ``decode(encode(s)) == s`` exactly.

``load_tokenizer`` picks a tokenizer by name ("bpe", "bytes") or from a saved file or checkpoint directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .tokenizer import FILE_NAME, SPECIAL_TOKENS, ByteTokenizer, ControlTokens, _utf8, tokenizer_file

KIND = "bpe"
SHIPPED = Path(__file__).parent / "assets" / FILE_NAME
_ESCAPED = re.compile("([\udc80-\udcff]+)")  # bytes that are not valid UTF-8, as surrogateescape spells them


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte -> printable char table (what ByteLevel writes in the vocab), inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_CHAR_TO_BYTE = _byte_chars()


def _padded(n: int) -> int:
    return (n + 15) // 16 * 16


def _new_hf_tokenizer() -> Tokenizer:
    hf = Tokenizer(models.BPE())
    # No normalizer, no prefix space: the tokens spell the text's UTF-8 bytes and nothing else.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()  # unused here (decode is ours), but keeps the HF file usable on its own
    return hf


class BPETokenizer(ControlTokens):
    """``n_text`` BPE ids, then the control tokens of ``SPECIAL_TOKENS``; the vocabulary is padded to a multiple of 16.

    Build one with ``train_bpe`` or ``BPETokenizer.load``; ``load_tokenizer()`` gives the shipped one.
    """

    def __init__(self, hf: Tokenizer) -> None:
        vocab = hf.get_vocab(with_added_tokens=True)
        n = len(vocab)
        if hf.get_added_tokens_decoder():
            raise ValueError("the HF tokenizer must not hold added/special tokens: control tokens live outside it")
        config = json.loads(hf.to_str())
        pre = config.get("pre_tokenizer") or {}
        exact = (config["model"].get("type"), config["model"].get("dropout"), config.get("normalizer"), pre.get("type"))
        if exact != ("BPE", None, None, "ByteLevel") or pre.get("add_prefix_space"):
            # anything else would change text (normalizer, prefix space) or make encode random (dropout)
            raise ValueError(
                "the HF tokenizer must be BPE without dropout or normalizer, with a ByteLevel pre-tokenizer "
                f"(add_prefix_space=False); got model/dropout/normalizer/pre-tokenizer {exact}, {pre}"
            )
        if sorted(vocab.values()) != list(range(n)):
            raise ValueError("the HF tokenizer's ids must be exactly 0..N-1")
        # id -> bytes, via ByteLevel's char table; every one of the 256 single bytes must have an id.
        self._bytes: list[bytes] = [b""] * n
        for token, i in vocab.items():
            try:
                self._bytes[i] = bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:
                raise ValueError(f"token {token!r} is not byte-level; train it with train_bpe") from None
        self._byte_ids = {b[0]: i for i, b in enumerate(self._bytes) if len(b) == 1}
        if len(self._byte_ids) != 256:
            raise ValueError(f"the vocabulary covers {len(self._byte_ids)} of 256 single bytes; all are needed")
        hf.no_truncation()
        hf.no_padding()
        self._hf = hf
        self._init_control_tokens(n)

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``. Never produces a control token, whatever the text says."""
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        except TypeError:  # lone surrogates (os/subprocess decoding) cannot cross into Rust: go through bytes
            pass
        ids: list[int] = []
        for k, part in enumerate(_ESCAPED.split(_utf8(text).decode("utf-8", errors="surrogateescape"))):
            if k % 2:  # undecodable bytes: one id each, as ByteTokenizer would
                ids += [self._byte_ids[ord(c) - 0xDC00] for c in part]
            elif part:
                ids += self._hf.encode(part, add_special_tokens=False).ids
        return ids

    def _text_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def to_dict(self) -> dict:
        return {
            "kind": KIND,
            "special_tokens": list(SPECIAL_TOKENS),
            "vocab_size": self.vocab_size,
            "hf_tokenizer": json.loads(self._hf.to_str()),
        }

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON to ``path`` (a file, or a directory that gets ``tokenizer.json``)."""
        path = tokenizer_file(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a tokenizer written by ``save`` (a file, or a directory holding ``tokenizer.json``)."""
        path = tokenizer_file(path)
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), where=str(path))

    @classmethod
    def from_dict(cls, data: dict, where: str = "tokenizer data") -> BPETokenizer:
        if data.get("kind") != KIND or not isinstance(data.get("hf_tokenizer"), dict):
            raise ValueError(f"{where} is not a BPE tokenizer written by BPETokenizer.save (kind={data.get('kind')!r})")
        try:
            tok = cls(Tokenizer.from_str(json.dumps(data["hf_tokenizer"])))
        except Exception as e:  # noqa: BLE001 - the HF parser raises plain Exception
            raise ValueError(f"{where}: the BPE model cannot be read: {e}") from e
        found = (tuple(data.get("special_tokens", ())), data.get("vocab_size"))
        if found != (SPECIAL_TOKENS, tok.vocab_size):
            raise ValueError(
                f"{where} describes control tokens/vocab_size {found} that this BPETokenizer "
                f"({SPECIAL_TOKENS}, {tok.vocab_size}) cannot reproduce; "
                "load it with the sandforge version that wrote it"
            )
        return tok


def train_bpe(texts: Iterable[str], vocab_size: int = 1024) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``texts``. Deterministic: the same texts give the same tokenizer.

    ``vocab_size`` is the model's full vocabulary, control tokens included: the BPE model gets ``vocab_size - 12`` ids
    (all 256 bytes, then merges), fewer if the texts run out of pairs worth merging (padding then fills the rest).
    """
    n_special = len(SPECIAL_TOKENS)
    if vocab_size % 16 or vocab_size < 256 + n_special:
        least = _padded(256 + n_special)
        raise ValueError(f"vocab_size must be a multiple of 16 and at least {least}, got {vocab_size}")
    hf = _new_hf_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    hf.train_from_iterator(texts, trainer)
    return BPETokenizer(hf)


def load_tokenizer(spec: str | Path | None = "bpe") -> BPETokenizer | ByteTokenizer:
    """The policy's tokenizer: ``"bpe"``/None (the shipped one), ``"bytes"``, or a saved file / checkpoint directory."""
    if spec is None or spec == "bpe":
        return BPETokenizer.load(SHIPPED)
    if spec == "bytes":
        return ByteTokenizer()
    path = tokenizer_file(spec)
    if not path.is_file():
        raise ValueError(
            f"unknown tokenizer {str(spec)!r}: use 'bpe' (the shipped BPE), 'bytes', or the path of a tokenizer.json "
            "or of a checkpoint directory holding one"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a tokenizer JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a tokenizer JSON file: expected an object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind == KIND:
        return BPETokenizer.from_dict(data, where=str(path))
    if kind is not None:
        raise ValueError(f"{path} holds a tokenizer of kind {kind!r}; this sandforge knows 'bpe' and byte tokenizers")
    if "model" in data and "type" not in data:
        raise ValueError(
            f"{path} looks like a bare Hugging Face tokenizer.json; the built-in policy loads tokenizers written by "
            "BPETokenizer.save or ByteTokenizer.save (an HF model's tokenizer goes with the hf policy instead)"
        )
    return ByteTokenizer.load(path)  # no kind marker: ByteTokenizer's format, which it checks itself
