"""Where text comes from: a text file, a directory of ``.txt`` / ``.jsonl`` files, the stdlib.

:func:`documents` yields the documents of ``--data PATH`` in a fixed order (files sorted by
path; a ``.txt`` file is one document; a ``.jsonl`` file gives one document per line, its
``text`` field), so on-the-fly tokenization and ``fmoe data prepare`` produce the same
token stream. :func:`tokenize` joins the documents' ids with the tokenizer's separator.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("hi"); _ = (d / "b.jsonl").write_text('{"text": "yo"}\\n')
    >>> [doc for _, doc in documents(d)]
    ['hi', 'yo']
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np

__all__ = ["documents", "document_pieces", "list_files", "tokenize", "token_dtype", "stdlib_bytes", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".jsonl")


def list_files(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> list[str]:
    """The text files named by ``paths`` (files as given, directories searched recursively for
    ``.txt``/``.jsonl``), sorted within each directory.

    Raises:
        ValueError: a path does not exist, a file has another suffix, or nothing is found.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs
                           if f.endswith(TEXT_SUFFIXES) and not f.startswith("."))
            if not found:
                raise ValueError(f"data {p!r}: a directory with no .txt or .jsonl files")
            out += found
        elif os.path.isfile(p):
            if not p.endswith(TEXT_SUFFIXES):
                raise ValueError(f"data {p!r}: a text file must end in .txt or .jsonl, got {os.path.basename(p)!r}")
            out.append(p)
        else:
            raise ValueError(f"data {p!r}: no such file or directory")
    return out


#: A ``.txt`` document is read and tokenized in pieces of about this many characters, so memory
#: stays a few bytes per input byte whatever the file's size.
PIECE_CHARS = 1 << 20


def _not_utf8(path: str) -> ValueError:
    """The error for a file that is not UTF-8 text, with the offset of its first bad byte."""
    dec, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            try:
                dec.decode(block)
            except UnicodeDecodeError as e:
                return ValueError(f"data {path!r}: not UTF-8 text ({e.reason} at byte {offset + e.start}); "
                                  "convert it to UTF-8 (e.g. iconv -t utf-8)")
            offset += len(block)
    return ValueError(f"data {path!r}: not UTF-8 text (it ends inside a character)")


def _jsonl(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"data {path!r} line {n}: not JSON ({e.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"data {path!r} line {n}: expected an object with a string field 'text'")
                yield row["text"]
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _cut(text: str) -> int:
    """Where a piece ends: after its last newline, else before its last space or tab (a word
    boundary for the usual pre-tokenizers), else at its end."""
    nl = text.rfind("\n") + 1
    return nl or max(text.rfind(" "), text.rfind("\t"), 0) or len(text)


def _text_pieces(path: str) -> Iterator[str]:
    """A ``.txt`` file's text in pieces of about :data:`PIECE_CHARS` characters, in order."""
    try:
        with open(path, encoding="utf-8") as f:
            carry = ""
            while block := f.read(PIECE_CHARS):
                text = carry + block
                cut = _cut(text)
                carry = text[cut:]
                yield text[:cut]
            if carry:
                yield carry
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def document_pieces(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
                    ) -> Iterator[tuple[str, Iterator[str]]]:
    """``(file, pieces)`` for every document of ``paths``, in order: a ``.jsonl`` row is one piece,
    a ``.txt`` file is read in pieces of about :data:`PIECE_CHARS` characters (each cut after a
    newline, or before a space in a longer line), so no whole file is held in memory."""
    for path in list_files(paths):
        if path.endswith(".jsonl"):
            for text in _jsonl(path):
                yield path, iter((text,))
        else:
            yield path, _text_pieces(path)


def documents(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> Iterator[tuple[str, str]]:
    """``(file, text)`` for every document of ``paths``, in order (see :func:`list_files`)."""
    for path, pieces in document_pieces(paths):
        yield path, "".join(pieces)


def tokenize(docs: Iterable[Union[str, Iterable[str]]], tokenizer, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """All documents' ids in one array, each document followed by ``tokenizer.eos_id`` (if any).

    Args:
        docs: texts, or documents given as iterables of text pieces (:func:`document_pieces`),
            each piece encoded on its own: memory is the ids plus one piece.
        tokenizer: from :func:`fmoe.data.load_tokenizer`.
        dtype: result dtype (default: the smallest of uint8/uint16/uint32 holding the vocabulary).

    Example:
        >>> from fmoe.data import ByteTokenizer
        >>> tokenize(["hi", iter(["h", "o"])], ByteTokenizer()).tolist()
        [104, 105, 0, 104, 111, 0]
    """
    dtype = np.dtype(dtype or token_dtype(tokenizer.vocab_size))
    eos = None if tokenizer.eos_id is None else np.asarray([tokenizer.eos_id], dtype=dtype)
    chunks = []
    for doc in docs:
        for piece in ((doc,) if isinstance(doc, str) else doc):
            chunks.append(tokenizer.encode_array(piece, dtype))
        if eos is not None:
            chunks.append(eos)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint8 for byte vocabularies, uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def stdlib_bytes(max_bytes: Optional[int] = 16_000_000) -> tuple[bytes, str]:
    """The standard library's ``.py`` files (sorted paths, NUL-separated) up to ``max_bytes``
    bytes, and the directory they came from: a corpus every machine with CPython has."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            with open(os.path.join(dirpath, fn), "rb") as f:
                chunks.append(f.read() + b"\0")
            total += len(chunks[-1])
            if max_bytes is not None and total >= max_bytes:
                break
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"stdlib_bytes: no .py files under {root}")
    return b"".join(chunks)[:max_bytes], root
