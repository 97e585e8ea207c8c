"""Checksums and path confinement for checkpoint files.

safetensors checks a file's header and length, not its bytes: a flipped bit in a tensor loads
silently. fmoe therefore records SHA-256 checksums when it writes a checkpoint and checks them
before anything is read into a model: a training checkpoint's ``meta.json`` holds one per file
(``"files"``); a Hugging Face export's safetensors files carry one per tensor in their own
header metadata (``"fmoe_sha256"``, a JSON string; other tools ignore it), so the export stays
exactly the files transformers writes.

A checkpoint directory is also a trust boundary: a file named by an index or a manifest must be
a plain file name inside the directory (no ``..``, no absolute path, no symlink leading out), so
a crafted checkpoint cannot make fmoe read, or reveal the existence of, files elsewhere.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "a.safetensors"), "wb") as f:
    ...     _ = f.write(b"abc")
    >>> sums = digests(d, ["a.safetensors"])
    >>> verify(d, sums, what="example")    # silent when every file matches
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Iterable, Mapping, Optional

import torch

__all__ = ["digest", "digests", "verify", "inside", "tensor_digest", "verify_tensors", "HEADER_KEY"]

HEADER_KEY = "fmoe_sha256"     # safetensors header metadata: JSON {tensor key: sha256}
_CHUNK = 1 << 22


def digest(file: str) -> str:
    """SHA-256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def digests(directory: str, names: Iterable[str]) -> dict[str, dict]:
    """``{name: {"sha256": hex, "bytes": size}}`` for files of ``directory``."""
    out = {}
    for name in sorted(names):
        file = os.path.join(directory, name)
        out[name] = {"sha256": digest(file), "bytes": os.path.getsize(file)}
    return out


def inside(directory: str, name: str, what: str) -> str:
    """The path of ``name`` in ``directory`` after checking it stays inside it.

    Args:
        directory: the checkpoint directory.
        name: a file name from an index or manifest.
        what: how to name the entry in the error (``"index entry 'x' -> 'y'"``).
    Returns:
        ``os.path.join(directory, name)``.
    Raises:
        ValueError: ``name`` is absolute, has a ``..`` component, or resolves (through a
        symlink) outside ``directory``.
    """
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name \
            or any(part in ("..", "") for part in name.split("/")):
        raise ValueError(f"{what}: file name {name!r} must be a relative path inside the checkpoint "
                         "directory (no '..', no absolute path)")
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise ValueError(f"{what}: {name!r} is a symlink leading outside the checkpoint directory "
                         f"{directory!r}; refusing to read it")
    return path


def verify(directory: str, expected: Mapping[str, Mapping], what: str,
           names: Optional[Iterable[str]] = None) -> None:
    """Check files of ``directory`` against recorded ``{name: {"sha256", "bytes"}}``.

    Args:
        directory: the checkpoint directory.
        expected: the recorded checksums.
        what: the record's name for errors (e.g. ``"OUT/step-4/meta.json"``).
        names: only these files (default: all recorded).
    Raises:
        ValueError: a file is missing, has another size or another SHA-256 (names the file).
    """
    for name in sorted(expected if names is None else names):
        rec = expected.get(name)
        if not isinstance(rec, Mapping) or not isinstance(rec.get("sha256"), str):
            raise ValueError(f"{what}: no valid checksum recorded for {name!r}")
        file = inside(directory, name, what)
        if not os.path.isfile(file):
            raise ValueError(f"{what} lists {name!r} but {file} does not exist")
        size = os.path.getsize(file)
        if rec.get("bytes") is not None and size != rec["bytes"]:
            raise ValueError(f"{file}: {size} bytes, {what} recorded {rec['bytes']}: the file was "
                             "truncated or changed after it was written")
        if digest(file) != rec["sha256"]:
            raise ValueError(f"{file}: SHA-256 differs from the one {what} recorded: the file is "
                             "corrupt (a changed byte) or was replaced after it was written")


def tensor_digest(t: "torch.Tensor") -> str:
    """SHA-256 of a tensor's bytes as safetensors stores them (contiguous, little-endian)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()


def _header(file: str) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts."""
    with open(file, "rb") as f:
        try:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        except (struct.error, ValueError) as e:
            raise ValueError(f"{file}: not a safetensors file (its header does not parse: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file (its header is a {type(header).__name__})")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: safetensors '__metadata__' must be an object of strings")
    return header, 8 + n


def _checksums(file: str, text: str) -> dict:
    """The ``fmoe_sha256`` metadata of ``file``: JSON ``{tensor key: sha256 hex}``, checked."""
    try:
        sums = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: safetensors metadata {HEADER_KEY!r} is not JSON ({e}); it must be a JSON "
                         "object {tensor name: SHA-256 hex}") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise ValueError(f"{file}: safetensors metadata {HEADER_KEY!r} must be a JSON object {{tensor name: "
                         f"SHA-256 hex}}, got {type(sums).__name__} {str(sums)[:80]}")
    return sums


def verify_tensors(file: str) -> bool:
    """Check every tensor of a safetensors file against the ``fmoe_sha256`` of its header.

    Returns:
        False when the file carries no checksums (written by another tool), True when checked.
    Raises:
        ValueError: naming the file and the tensor whose bytes differ.
    """
    header, start = _header(file)
    sums = header.get("__metadata__", {}).get(HEADER_KEY)
    if sums is None:
        return False
    sums = _checksums(file, sums)
    with open(file, "rb") as f:
        for key in sorted(sums):
            if key not in header:
                raise ValueError(f"{file}: checksum recorded for {key!r}, which the file does not hold")
            lo, hi = header[key]["data_offsets"]
            f.seek(start + lo)
            h, left = hashlib.sha256(), hi - lo
            while left:
                block = f.read(min(_CHUNK, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            if h.hexdigest() != sums[key]:
                raise ValueError(f"{file}: tensor {key!r} does not match the SHA-256 fmoe recorded when "
                                 "writing it: the file is corrupt (a changed byte)")
    return True
