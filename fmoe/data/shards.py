"""Pre-tokenized shards: flat token files read with ``numpy.memmap``, plus a JSON header.

Layout of a shard directory (what ``python -m fmoe.data prepare`` writes)::

    DIR/header.json        {"format": "fmoe-tokens", "version": 1, "dtype": "uint16",
                            "vocab_size": V, "eos_id": ..., "tokenizer": ...,
                            "shards": [{"file": "shard-00000.bin", "tokens": N0}, ...]}
    DIR/shard-00000.bin    N0 ids, little-endian ``dtype``, no header (as nanoGPT's train.bin)

``header.json`` is written last, so a directory without it is an unfinished ``prepare``.
:func:`open_shards` maps the files (nothing is read until a batch needs it) and checks each
file's size against the header.

Example:
    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> write_shards(d, [np.arange(5, dtype=np.uint16)], vocab_size=10, shard_tokens=3).shards
    [3, 2]
    >>> open_shards(d).tokens().tolist()
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from .stream import TokenStream

__all__ = ["write_shards", "open_shards", "is_shard_dir", "ShardInfo", "HEADER", "FORMAT"]

HEADER, FORMAT = "header.json", "fmoe-tokens"
_DTYPES = ("uint8", "uint16", "uint32")


@dataclass
class ShardInfo:
    """What :func:`write_shards` wrote: the directory, tokens per shard and the header."""

    path: str
    shards: list = field(default_factory=list)
    header: dict = field(default_factory=dict)


def is_shard_dir(path: str) -> bool:
    """Whether ``path`` is a directory with a shard ``header.json``."""
    return os.path.isfile(os.path.join(path, HEADER))


def write_shards(out: str, chunks: Iterable[np.ndarray], *, vocab_size: int, eos_id: Optional[int] = None,
                 tokenizer: str = "", shard_tokens: int = 100_000_000, dtype: Optional[str] = None,
                 extra: Optional[dict] = None) -> ShardInfo:
    """Write token arrays as shards of at most ``shard_tokens`` ids each.

    Args:
        out: a new or empty directory.
        chunks: 1-D integer arrays, concatenated in order.
        vocab_size: vocabulary size (recorded; every id must be below it).
        eos_id, tokenizer: recorded in the header.
        shard_tokens: ids per shard file.
        dtype: ``uint8``/``uint16``/``uint32`` (default: smallest holding ``vocab_size``).
        extra: more header fields (e.g. the source files).
    Returns:
        :class:`ShardInfo`.
    """
    from .sources import token_dtype

    dtype = str(np.dtype(dtype)) if dtype else str(token_dtype(vocab_size))
    if dtype not in _DTYPES or np.iinfo(dtype).max + 1 < vocab_size:
        raise ValueError(f"write_shards: dtype {dtype!r} cannot hold vocab_size={vocab_size}; use one of {_DTYPES}")
    if shard_tokens < 1:
        raise ValueError(f"write_shards: shard_tokens must be >= 1, got {shard_tokens}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"write_shards: {out!r} exists and is not an empty directory")
    os.makedirs(out, exist_ok=True)
    info, f, n_in = ShardInfo(out), None, 0

    def open_next():
        info.shards.append(0)
        return open(os.path.join(out, f"shard-{len(info.shards) - 1:05d}.bin"), "wb")

    try:
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab_size):
                raise ValueError(f"write_shards: token ids must be in [0, {vocab_size}), got "
                                 f"[{chunk.min()}, {chunk.max()}]")
            chunk = chunk.astype(dtype, copy=False)
            while chunk.size:
                if f is None or n_in == shard_tokens:
                    f = (f.close(), open_next())[1] if f else open_next()
                    n_in = 0
                take = chunk[: shard_tokens - n_in]
                take.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tofile(f)
                n_in += take.size
                info.shards[-1] += int(take.size)
                chunk = chunk[take.size:]
    finally:
        if f:
            f.close()
    info.header = {"format": FORMAT, "version": 1, "dtype": dtype, "vocab_size": int(vocab_size),
                   "eos_id": eos_id, "tokenizer": tokenizer, "tokens": int(sum(info.shards)),
                   "shards": [{"file": f"shard-{i:05d}.bin", "tokens": n} for i, n in enumerate(info.shards)],
                   **(extra or {})}
    with open(os.path.join(out, HEADER + ".tmp"), "w") as h:
        json.dump(info.header, h, indent=1)
    os.replace(os.path.join(out, HEADER + ".tmp"), os.path.join(out, HEADER))
    return info


def read_header(path: str) -> dict:
    """The checked ``header.json`` of a shard directory."""
    try:
        with open(os.path.join(path, HEADER)) as f:
            h = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"data {path!r}: cannot read {HEADER} ({e})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("dtype") not in _DTYPES:
        raise ValueError(f"data {path!r}: {HEADER} is not an fmoe token header (format {FORMAT!r}, "
                         f"dtype one of {_DTYPES})")
    if not isinstance(h.get("vocab_size"), int) or not isinstance(h.get("shards"), list):
        raise ValueError(f"data {path!r}: {HEADER} needs an int 'vocab_size' and a list 'shards'")
    return h


def open_shards(path: str) -> TokenStream:
    """A :class:`TokenStream` over the shard files of ``path`` (memory-mapped, read-only)."""
    h = read_header(path)
    parts = []
    for s in h["shards"]:
        name = s.get("file") if isinstance(s, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise ValueError(f"data {path!r}: shard entry {s!r} must name a file inside the directory")
        file = os.path.join(path, name)
        n = int(s.get("tokens", -1))
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size != n * np.dtype(h["dtype"]).itemsize:
            raise ValueError(f"data {file!r}: {size} bytes on disk, header says {n} {h['dtype']} tokens")
        if n:
            parts.append(np.memmap(file, dtype=np.dtype(h["dtype"]).newbyteorder("<"), mode="r", shape=(n,)))
    return TokenStream(parts, f"shards:{path}", vocab_size=h["vocab_size"])
