"""Tokenizers: byte-level (fixed, any UTF-8), character-level (a corpus's alphabet) and
byte-level BPE (HF `tokenizers`). Every kind saves to and loads from one `tokenizer.json`,
which travels with the token shards and with every checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from raytrain_lm import storage
from raytrain_lm.errors import UserError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
_FORMAT_KEY = "raytrain_lm_tokenizer"


class Tokenizer:
    """Common interface: ids are ints in [0, vocab_size); `eot_id` separates documents."""

    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus one end-of-text id. Needs no training."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({_FORMAT_KEY: "byte", "eot": EOT}, sort_keys=True)


class CharTokenizer(Tokenizer):
    """One id per character of a fixed alphabet (nanoGPT's shakespeare_char), plus end-of-text."""

    kind = "char"

    def __init__(self, alphabet: Iterable[str]):
        self.chars = sorted(set(alphabet))
        if not self.chars:
            raise UserError("cannot build a character tokenizer from an empty corpus")
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.eot_id = len(self.chars)
        self.vocab_size = len(self.chars) + 1

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        alphabet: set[str] = set()
        for text in texts:
            alphabet.update(text)
        return cls(alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as exc:
            raise UserError(
                f"character {exc.args[0]!r} is not in the tokenizer's alphabet"
            ) from None

    def encode_known(self, text: str) -> tuple[list[int], int]:
        """Ids of the characters in the alphabet, and how many characters were not."""
        ids = [self._index[c] for c in text if c in self._index]
        return ids, len(text) - len(ids)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))

    def to_json(self) -> str:
        return json.dumps({_FORMAT_KEY: "char", "chars": self.chars, "eot": EOT}, sort_keys=True)


class BPETokenizer(Tokenizer):
    """Byte-level BPE from HF `tokenizers` (GPT-2 style); handles any UTF-8 text."""

    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        eot = self._tok.token_to_id(EOT)
        if eot is None:
            raise UserError(f"BPE tokenizer has no '{EOT}' token")
        self.eot_id = eot
        self.vocab_size = self._tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterator[str] | list[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, text: str) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str()


def tokenizer_from_json(text: str, origin: str = "tokenizer") -> Tokenizer:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{origin}: not valid JSON ({exc.msg})") from None
    kind = meta.get(_FORMAT_KEY) if isinstance(meta, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(meta["chars"])
    try:
        return BPETokenizer.from_str(text)
    except Exception as exc:  # HF raises a bare Exception on a malformed file
        raise UserError(f"{origin}: not a tokenizer file ({exc})".splitlines()[0]) from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads `tokenizer.json` from a file or the folder holding it (local path or URI)."""
    file = str(path)
    if not file.endswith(".json"):
        file = storage.join(file, TOKENIZER_FILE)
    try:
        text = storage.read_bytes(file).decode("utf-8")
    except (OSError, ValueError):
        raise UserError(f"tokenizer file not found: {file}") from None
    return tokenizer_from_json(text, file)


def token_dtype(vocab_size: int) -> np.dtype:
    """The most compact unsigned integer type holding every id."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
