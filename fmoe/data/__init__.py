"""Training data: your text or pre-tokenized shards, your tokenizer, deterministic batches.

``--data PATH`` of the main job is opened by :func:`open_data`:

- nothing: the Python standard library's source as byte tokens (offline everywhere);
- a ``.txt`` / ``.jsonl`` file or a directory of them: tokenized on the fly
  (:mod:`fmoe.data.sources`; ``.jsonl`` rows give their ``text`` field);
- a shard directory written by ``fmoe data prepare`` (:mod:`fmoe.data.shards`):
  flat ``uint16``/``uint32`` token files read with ``numpy.memmap`` plus ``header.json``.

``--tokenizer`` is ``bytes`` or a Hugging Face ``tokenizer.json`` (:mod:`fmoe.data.tokenizer`).
Batches are a pure function of ``(seed, step, batch index)`` and each data-parallel batch reads
a disjoint slice of the stream (:class:`TokenStream`); the held-out split is the stream's tail.

Example:
    >>> train, held_out = open_data(None, max_bytes=50_000).split(0.1)
    >>> x, y = train.batch(step=1, batch_index=0, batch=2, seq=8, seed=0)
    >>> x.shape, len(held_out)
    (torch.Size([2, 8]), 5000)
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from .identity import data_digest
from .shards import is_shard_dir, open_shards, read_header, write_shards
from .sources import document_pieces, documents, list_files, stdlib_bytes, token_dtype, tokenize
from .stream import TokenStream
from .tokenizer import TOKENIZER_FILES, ByteTokenizer, HFTokenizer, find_tokenizer_file, load_tokenizer

__all__ = ["TokenStream", "open_data", "data_digest", "prepare", "load_tokenizer", "find_tokenizer_file", "ByteTokenizer",
           "HFTokenizer", "TOKENIZER_FILES", "documents", "document_pieces", "list_files", "tokenize", "token_dtype",
           "stdlib_bytes", "write_shards", "open_shards", "is_shard_dir", "read_header"]

PathLike = Union[str, os.PathLike]


def open_data(path: Optional[PathLike], tokenizer=None, *, max_bytes: Optional[int] = 16_000_000) -> TokenStream:
    """The token stream of ``--data PATH``.

    Args:
        path: None (standard library bytes), a text file or directory, or a shard directory.
        tokenizer: for text (default: bytes); for shards, if given, it must be the one the header
            records (the same ``digest``; the same vocabulary size for headers without one).
        max_bytes: cap on the standard library corpus.
    Returns:
        a :class:`TokenStream` whose ``vocab_size`` is set.
    """
    tok = tokenizer or ByteTokenizer()
    if path is None:
        if not isinstance(tok, ByteTokenizer):
            raise ValueError("open_data: the built-in corpus is byte tokens; pass --data PATH to use "
                             f"tokenizer {tok.name!r}")
        return TokenStream.stdlib(max_bytes)
    path = os.fspath(path)
    if os.path.isdir(path) and is_shard_dir(path):
        stream = open_shards(path)
        header = read_header(path)
        if tokenizer is not None and tokenizer.vocab_size != stream.vocab_size:
            raise ValueError(f"data {path!r}: shards have vocab_size={stream.vocab_size} but tokenizer "
                             f"{tokenizer.name!r} has {tokenizer.vocab_size}")
        made_by = header.get("tokenizer_digest")
        if tokenizer is not None and made_by is not None and getattr(tokenizer, "digest", None) != made_by:
            raise ValueError(f"data {path!r}: the shards were tokenized with {header.get('tokenizer')!r} "
                             f"({made_by}), not with tokenizer {tokenizer.name!r} ({getattr(tokenizer, 'digest', None)}); "
                             "pass the tokenizer that made them (or leave --tokenizer out to use it)")
        return stream
    ids = tokenize((pieces for _, pieces in document_pieces(path)), tok)
    return TokenStream([ids], f"text:{path}", vocab_size=tok.vocab_size)


def prepare(files: Sequence[PathLike], tokenizer, out: PathLike, *, shard_tokens: int = 100_000_000,
            progress: bool = True) -> dict:
    """Tokenize ``files`` (text files or directories) into a shard directory ``out``.

    The shards hold exactly the ids :func:`open_data` would produce from the same files on the
    fly, so both give the same batches.

    Args:
        files: text files / directories, in order.
        tokenizer: from :func:`load_tokenizer`.
        out: a new or empty directory (written atomically: all shards or nothing).
        shard_tokens: ids per shard file.
        progress: show a progress bar over the files (stderr).
    Returns:
        the header written to ``out/header.json``.
    """
    from tqdm import tqdm

    paths = list_files(files)

    def chunks():
        for path in tqdm(paths, desc="tokenizing", unit="file", disable=not progress):
            yield tokenize((pieces for _, pieces in document_pieces(path)), tokenizer)

    return write_shards(os.fspath(out), chunks(), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                        tokenizer=tokenizer.name, shard_tokens=shard_tokens,
                        extra={"sources": [os.path.abspath(p) for p in paths],
                               "tokenizer_digest": tokenizer.digest}).header
