"""Pre-tokenized shards: flat token files read with ``numpy.memmap``, plus a JSON header.

Layout of a shard directory (what ``fmoe data prepare`` writes)::

    DIR/header.json        {"format": "fmoe-tokens", "version": 1, "dtype": "uint16",
                            "vocab_size": V, "eos_id": ..., "tokenizer": ...,
                            "shards": [{"file": "shard-00000.bin", "tokens": N0, "sha256": ...}, ...]}
    DIR/shard-00000.bin    N0 ids, little-endian ``dtype``, no header (as nanoGPT's train.bin)

:func:`write_shards` writes the whole directory atomically (:mod:`fmoe.checkpoint.atomic`): into
a hidden temporary directory beside ``DIR`` that becomes ``DIR`` only when complete, so a failed
or killed ``prepare`` leaves no partial shards (a rerun just works). :func:`open_shards` checks
every header field (types, ranges, file names inside the directory) and each file's size
against the header, then maps the files (nothing is read until a batch needs it).

Example:
    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> write_shards(d, [np.arange(5, dtype=np.uint16)], vocab_size=10, shard_tokens=3).shards
    [3, 2]
    >>> open_shards(d).tokens().tolist()
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import hashlib
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
        raise ValueError(f"shards: dtype {dtype!r} cannot hold vocab_size={vocab_size}; use one of {_DTYPES}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shards: --shard-tokens must be an integer >= 1, got {shard_tokens!r}")
    if os.path.islink(out):
        raise ValueError(f"shards {out!r}: a symbolic link (to {os.readlink(out)!r}); pass a real directory")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"shards {out!r}: exists and is not an empty directory (choose a new one)")
    from ..checkpoint import atomic

    final, out = out, atomic.begin(out)
    try:
        info = _write(out, chunks, vocab_size, eos_id, tokenizer, shard_tokens, dtype, extra)
        atomic.commit(out, final)
    except BaseException:
        atomic.abort(out)
        raise
    info.path = final
    return info


def _write(out, chunks, vocab_size, eos_id, tokenizer, shard_tokens, dtype, extra) -> ShardInfo:
    info, f, n_in, sums = ShardInfo(out), None, 0, []

    def open_next():
        info.shards.append(0)
        sums.append(hashlib.sha256())                 # each shard's digest, as it is written
        name = os.path.join(out, f"shard-{len(info.shards) - 1:05d}.bin")
        return os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb")

    try:
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab_size):
                raise ValueError(f"shards: token ids must be in [0, {vocab_size}), got "
                                 f"[{chunk.min()}, {chunk.max()}]")
            chunk = chunk.astype(dtype, copy=False)
            while chunk.size:
                if f is None or n_in == shard_tokens:
                    f = (f.close(), open_next())[1] if f else open_next()
                    n_in = 0
                take = chunk[: shard_tokens - n_in]
                data = take.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes()
                f.write(data)
                sums[-1].update(data)
                n_in += take.size
                info.shards[-1] += int(take.size)
                chunk = chunk[take.size:]
    finally:
        if f:
            f.close()
    info.header = {"format": FORMAT, "version": 1, "dtype": dtype, "vocab_size": int(vocab_size),
                   "eos_id": eos_id, "tokenizer": tokenizer, "tokens": int(sum(info.shards)),
                   "shards": [{"file": f"shard-{i:05d}.bin", "tokens": n, "sha256": sums[i].hexdigest()}
                              for i, n in enumerate(info.shards)],
                   **(extra or {})}
    with os.fdopen(os.open(os.path.join(out, HEADER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644),
                   "w") as h:
        json.dump(info.header, h, indent=1)
    return info


def read_header(path: str) -> dict:
    """The checked ``header.json`` of a shard directory."""
    try:
        with open(os.path.join(path, HEADER)) as f:
            h = json.load(f)
    except (OSError, ValueError) as e:          # ValueError: not JSON, or not UTF-8 text
        raise ValueError(f"data {path!r}: cannot read {os.path.join(path, HEADER)} ({e})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("dtype") not in _DTYPES:
        raise ValueError(f"data {path!r}: {HEADER} is not an fmoe token header (format {FORMAT!r}, "
                         f"dtype one of {_DTYPES})")
    file = os.path.join(path, HEADER)
    v = h.get("vocab_size")
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= np.iinfo(h["dtype"]).max + 1:
        raise ValueError(f"{file}: 'vocab_size' must be an integer in [1, {np.iinfo(h['dtype']).max + 1}] "
                         f"(dtype {h['dtype']}), got {v!r}")
    if not isinstance(h.get("shards"), list):
        raise ValueError(f"{file}: 'shards' must be a list, got {h.get('shards')!r}")
    eos = h.get("eos_id")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < v):
        raise ValueError(f"{file}: 'eos_id' must be null or an integer in [0, {v}), got {eos!r}")
    for key in ("tokenizer", "tokenizer_digest"):
        if h.get(key) is not None and not isinstance(h[key], str):
            raise ValueError(f"{file}: {key!r} must be a string, got {h[key]!r}")
    for s in h["shards"]:
        name = s.get("file") if isinstance(s, dict) else None
        n = s.get("tokens") if isinstance(s, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"{file}: shard entry {s!r} must name a file inside the directory")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{file}: shard entry {s!r} must have an integer 'tokens' >= 0")
    return h


def open_shards(path: str) -> TokenStream:
    """A :class:`TokenStream` over the shard files of ``path`` (memory-mapped, read-only)."""
    h = read_header(path)
    parts = []
    for s in h["shards"]:
        file, n = os.path.join(path, s["file"]), s["tokens"]
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size != n * np.dtype(h["dtype"]).itemsize:
            raise ValueError(f"data {file!r}: {size} bytes on disk, header says {n} {h['dtype']} tokens")
        if n:
            parts.append(np.memmap(file, dtype=np.dtype(h["dtype"]).newbyteorder("<"), mode="r", shape=(n,)))
    return TokenStream(parts, f"shards:{path}", vocab_size=h["vocab_size"])
