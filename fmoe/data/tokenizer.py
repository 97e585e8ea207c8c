"""Tokenizers for the training data: raw bytes, or a Hugging Face ``tokenizer.json``.

A tokenizer here is anything with ``name``, ``vocab_size``, ``eos_id`` (the id that separates
documents in a token stream; None when it has none), ``digest`` (what identifies it: ``"bytes"``,
or the SHA-256 of its ``tokenizer.json``; shard headers and checkpoints record it, so data
tokenized with one tokenizer is never read with another of the same vocabulary size) and
``encode(text) -> list[int]``.
:func:`load_tokenizer` turns the ``--tokenizer`` flag into one:

- ``"bytes"`` (the default when no tokenizer is given): UTF-8 bytes, ids 0..255, documents
  separated by NUL (id 0);
- a ``tokenizer.json`` file, or a directory holding one (a Hugging Face model directory): loaded
  with the ``tokenizers`` package; the separator is the ``eos_token`` of a
  ``tokenizer_config.json`` beside it, else the first of the usual end-of-text tokens the
  vocabulary contains.

Example:
    >>> tok = load_tokenizer("bytes")
    >>> tok.encode("hé"), tok.vocab_size, tok.eos_id
    ([104, 195, 169], 256, 0)
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Protocol, Union

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "find_tokenizer_file",
           "TOKENIZER_FILES"]

#: Files that make up a Hugging Face tokenizer (copied by ``--export-hf``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: Optional[int]
    digest: str

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255); NUL separates documents."""

    name, vocab_size, eos_id, digest = "bytes", 256, 0, "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        """The ids of ``text`` as an array (one byte per id while encoding, not a list of ints)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype, copy=False)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json`` file.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self.path = os.path.abspath(path)
        self.name = self.path
        with open(self.path, "rb") as f:
            data = f.read()
        self.digest = "sha256:" + hashlib.sha256(data).hexdigest()
        try:
            self._tok = _Tok.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (the tokenizers package raises plain Exceptions)
            raise ValueError(f"tokenizer {self.path!r}: not a valid Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos()

    def _find_eos(self) -> Optional[int]:
        cfg = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        names = list(_EOS_GUESSES)
        if os.path.isfile(cfg):
            try:
                with open(cfg, encoding="utf-8") as f:
                    conf = json.load(f)
            except ValueError as e:                      # not JSON, or not UTF-8
                raise ValueError(f"tokenizer config {cfg!r}: not a JSON file ({e})") from None
            if not isinstance(conf, dict):
                raise ValueError(f"tokenizer config {cfg!r}: must be a JSON object (with an optional "
                                 f"'eos_token'), got a {type(conf).__name__}")
            eos = conf.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        """The ids of ``text`` as an array of ``dtype``."""
        return np.asarray(self.encode(text), dtype=dtype)

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a generation prompt (with the tokenizer's special tokens, e.g. a BOS)."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode(ids)


def find_tokenizer_file(path: Union[str, os.PathLike]) -> Optional[str]:
    """``path`` if it is a file, ``path/tokenizer.json`` if that exists, else None."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    cand = os.path.join(path, "tokenizer.json")
    return cand if os.path.isfile(cand) else None


def load_tokenizer(spec: Union[str, os.PathLike, None]) -> Union[ByteTokenizer, HFTokenizer]:
    """The tokenizer named by ``--tokenizer``.

    Args:
        spec: ``"bytes"`` or None (byte tokens), a ``tokenizer.json`` file, or a directory with one.
    Returns:
        a :class:`ByteTokenizer` or :class:`HFTokenizer`.
    Raises:
        ValueError: ``spec`` is neither ``"bytes"`` nor a path to a tokenizer.
    """
    if spec is None or spec == "bytes":
        return ByteTokenizer()
    found = find_tokenizer_file(spec)
    if found is None:
        raise ValueError(f"tokenizer {os.fspath(spec)!r}: not 'bytes', a tokenizer.json file, or a "
                         "directory holding tokenizer.json")
    return HFTokenizer(found)
