"""Hugging Face checkpoint directories: open, look up keys, read slices, write.

The hub layout is a directory with ``config.json`` and either one ``model.safetensors`` or
several ``model-0000i-of-0000n.safetensors`` files named by ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {key: file}}``). :class:`Checkpoint` opens such a directory,
checks it (every file present and readable, every indexed key in its file), and then reads
*blocks* of tensors with ``safe_open(...).get_slice(key)[index]``: the file is memory-mapped and
only the requested block is copied out. ``bytes_read`` counts the bytes of every block returned,
so a benchmark can show that a rank read only its share.

Errors name what is wrong: a missing directory, ``config.json`` or shard file raises
``FileNotFoundError``; a corrupt or truncated safetensors file, a bad JSON file or an index that
does not match its files raises ``ValueError`` naming the file. safetensors checks at open time
that the header is valid and that the file covers every tensor it declares, so a truncated file
is caught before anything is read. The format has no checksum of the tensor bytes, so
:func:`write_checkpoint` records a SHA-256 per tensor in each file's header metadata and
``load_hf`` checks them when present (see :mod:`fmoe.checkpoint.integrity`).

:func:`write_checkpoint` writes the same layout (single file below ``max_shard_size``, otherwise
numbered shards and an index), as transformers' ``save_pretrained`` does.

Example:
    >>> import shutil, tempfile
    >>> tmp = tempfile.mkdtemp()
    >>> write_checkpoint(tmp, {"model.embed_tokens.weight": torch.ones(256, 8)}, {"model_type": "llama"})
    ['config.json', 'model.safetensors']
    >>> with Checkpoint(tmp) as ck:
    ...     w = ck.read("model.embed_tokens.weight", (slice(0, 128), slice(None)))
    ...     print(tuple(w.shape), ck.bytes_read)        # half the rows read, half the bytes
    (128, 8) 4096
    >>> shutil.rmtree(tmp)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Optional, Union

import safetensors
import safetensors.torch
import torch

from .canonical import sort_metadata
from .integrity import HEADER_KEY, inside, tensor_digest
from .progress import bar

__all__ = ["Checkpoint", "write_checkpoint", "parse_size", "CONFIG", "SINGLE", "INDEX"]

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2}


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e


class Checkpoint:
    """A read-only Hugging Face checkpoint directory (see the module docstring).

    Args:
        path: the directory.

    Attributes:
        path: the directory; ``config``: the parsed ``config.json``; ``bytes_read``: bytes of
        tensor data returned by :meth:`read` so far.

    Example:
        >>> import shutil, tempfile
        >>> tmp = tempfile.mkdtemp()
        >>> _ = write_checkpoint(tmp, {"lm_head.weight": torch.arange(6.0).reshape(3, 2)}, {})
        >>> ck = Checkpoint(tmp)
        >>> ck.shape("lm_head.weight"), ck.read("lm_head.weight", (slice(1, 2),)).tolist()
        ((3, 2), [[2.0, 3.0]])
        >>> ck.close(); shutil.rmtree(tmp)
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"checkpoint directory {self.path!r} does not exist")
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"checkpoint path {self.path!r} is not a directory; pass the "
                                    f"directory holding {CONFIG} and the safetensors files")
        config = os.path.join(self.path, CONFIG)
        if not os.path.isfile(config):
            raise FileNotFoundError(f"checkpoint directory {self.path!r} has no {CONFIG} "
                                    f"(expected {config})")
        self.config: dict = _read_json(config)
        if not isinstance(self.config, dict):
            raise ValueError(f"{config}: expected a JSON object, got {type(self.config).__name__}")
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}     # key -> file path
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            self._open_indexed(index)
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            file = inside(self.path, SINGLE, f"checkpoint {self.path!r}")
            self._where = {k: file for k in self._open(file).keys()}
        else:
            raise FileNotFoundError(f"checkpoint directory {self.path!r} has neither {SINGLE} nor "
                                    f"{INDEX}; it holds {sorted(os.listdir(self.path))}")

    def _open_indexed(self, index: str) -> None:
        body = _read_json(index)
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: expected an object with a 'weight_map' of key -> file name")
        for key, name in weight_map.items():                # every entry stays in the directory
            inside(self.path, name, f"{index}: weight_map entry {key!r}")
        for name in sorted(set(weight_map.values())):
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                keys = [k for k, v in weight_map.items() if v == name]
                raise FileNotFoundError(f"{file}: shard file named by {index} does not exist "
                                        f"(it should hold {len(keys)} tensors, e.g. {keys[:3]})")
            present = set(self._open(file).keys())
            missing = [k for k, v in weight_map.items() if v == name and k not in present]
            if missing:
                raise ValueError(f"{file}: {index} maps {len(missing)} key(s) to this file but it does "
                                 f"not hold them: {missing[:5]}")
        self._where = {k: os.path.join(self.path, v) for k, v in weight_map.items()}

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safetensors.safe_open(file, framework="pt", device="cpu")
            except (safetensors.SafetensorError, OSError) as e:
                raise ValueError(f"{file}: unreadable safetensors file, truncated or corrupt ({e})") from e
        return self._handles[file]

    # ------------------------------------------------------------------------------ queries
    def keys(self) -> list[str]:
        """Every tensor key in the checkpoint (sorted)."""
        return sorted(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        """Path of the file that holds ``key``."""
        if key not in self._where:
            raise ValueError(f"checkpoint {self.path!r} has no tensor {key!r}")
        return self._where[key]

    def _slice(self, key: str):
        file = self.file_of(key)
        try:
            return self._open(file).get_slice(key)
        except safetensors.SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {key!r} ({e})") from e

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of tensor ``key`` (from the file header; reads no data)."""
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """torch dtype of tensor ``key`` (from the file header)."""
        code = self._slice(key).get_dtype()
        if code not in _DTYPES:
            raise ValueError(f"{self.file_of(key)}: tensor {key!r} has dtype {code}, which fmoe cannot "
                             f"load (supported: {sorted(_DTYPES)})")
        return _DTYPES[code]

    def read(self, key: str, index: tuple = ()) -> torch.Tensor:
        """The block ``tensor[index]`` of ``key``, copied out of the file; counts its bytes.

        Args:
            key: checkpoint key.
            index: tuple of slices (``()`` reads the whole tensor).
        Returns:
            a tensor owning its memory.
        """
        sl = self._slice(key)
        try:
            t = sl[index] if index else sl[:]
        except Exception as e:  # safetensors raises its own error types for bad slices
            raise ValueError(f"{self.file_of(key)}: cannot read {key!r}[{index}] ({e})") from e
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Release the memory maps."""
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self._where)} tensors, {len(set(self._where.values()))} file(s))"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an int, or a string such as ``"50GB"`` or ``"5MiB"``.

    Example:
        >>> parse_size("5MB")
        5000000
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper()) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive int of bytes or a string like '50GB' or "
                         f"'500MiB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def write_checkpoint(directory: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                     max_shard_size: Union[int, str] = "50GB", progress: Optional[str] = None) -> list[str]:
    """Write ``config.json`` and the tensors into ``directory`` in the hub layout.

    Tensors go into files in the given order, a new file starting when the next tensor would
    push the current one past ``max_shard_size`` (a tensor larger than that gets a file of its
    own); one file is ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``.

    Args:
        directory: an existing, empty directory.
        tensors: ``{hf_key: tensor}`` (made contiguous for writing).
        config: the ``config.json`` content.
        max_shard_size: largest file size in bytes (int or ``"50GB"``-style string).
        progress: the label of a bar on stderr over the files written (None: no bar;
            :mod:`fmoe.checkpoint.progress`).
    Returns:
        the names of the files written.

    Example:
        >>> import shutil, tempfile
        >>> tmp = tempfile.mkdtemp()
        >>> write_checkpoint(tmp, {"a": torch.ones(4), "b": torch.ones(4)}, {}, max_shard_size=16)  # 16 bytes each
        ['config.json', 'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
        >>> shutil.rmtree(tmp)
    """
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    with open(os.path.join(directory, CONFIG), "w", encoding="utf-8") as f:
        f.write(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    with bar(progress or "", names, progress is not None) as next_part:
        for name, keys in zip(names, shards):
            own = {k: _own_storage(tensors[k]) for k in keys}
            sums = json.dumps({k: tensor_digest(t) for k, t in own.items()}, sort_keys=True)
            safetensors.torch.save_file(own, os.path.join(directory, name),
                                        metadata={"format": "pt", HEADER_KEY: sums})
            sort_metadata(os.path.join(directory, name))      # byte-reproducible (fmoe.checkpoint.canonical)
            next_part()
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        params = sum(t.numel() for t in tensors.values())
        index = {"metadata": {"total_parameters": params, "total_size": total},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX)
    return [CONFIG] + names


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, and a copy if it is a view into a larger storage (safetensors refuses tensors
    that share memory, such as the gate and up halves split out of one fused weight)."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
