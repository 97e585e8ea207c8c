"""Byte-reproducible safetensors files: the header's ``__metadata__`` in sorted key order.

The safetensors writer keeps the header's ``__metadata__`` in a Rust ``HashMap``, whose iteration
order is drawn anew in every process: two identical runs write the same tensors and the same
metadata, in a different order, so their files (and the SHA-256s ``meta.json`` records) differ.
:func:`sort_metadata` rewrites a written file's header in place with the metadata keys sorted,
everything else as it was (tensor entries in their order, the same JSON spelling, the header's
length kept by its trailing-space padding): the file then depends only on its content.

Example:
    >>> import os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> f = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> save_file({"x": torch.zeros(2)}, f, metadata={"b": "1", "a": "2"})
    >>> sort_metadata(f)
    >>> open(f, "rb").read(8 + 20)[8:]
    b'{"__metadata__":{"a"'

"""

from __future__ import annotations

import json
import os
from typing import Any

from .integrity import _header

__all__ = ["sort_metadata"]


def _dump(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()


def sort_metadata(file: str) -> None:
    """Rewrite ``file``'s header with its ``__metadata__`` keys sorted (in place, same length).

    Args:
        file: a safetensors file (written by ``safetensors`` or torch's DCP writer).
    Raises:
        ValueError: the file is not safetensors, or its header does not re-serialize to at most
            its own length (a writer spelling JSON differently from compact ``serde_json``).
    """
    header, start = _header(file)
    n = start - 8
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or list(meta) == sorted(meta):
        return
    header["__metadata__"] = {k: meta[k] for k in sorted(meta)}
    raw = _dump(header)
    if len(raw) > n:
        raise ValueError(f"{file}: its header re-serializes to {len(raw)} bytes, more than its {n}")
    raw += b" " * (n - len(raw))          # safetensors pads the header with spaces (8-byte alignment)
    fd = os.open(file, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, raw, 8)
    finally:
        os.close(fd)
