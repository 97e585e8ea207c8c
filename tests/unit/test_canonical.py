"""Byte-reproducible safetensors files (fmoe.checkpoint.canonical): the same tensors and metadata
give the same bytes whatever order the writer put the metadata in; the file stays valid."""

from __future__ import annotations

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fmoe.checkpoint.canonical import sort_metadata
from fmoe.checkpoint.integrity import HEADER_KEY, tensor_digest, verify_tensors


def _write(path, order):
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    meta = {"format": "pt", HEADER_KEY: json.dumps({k: tensor_digest(t) for k, t in tensors.items()}), "z": "1"}
    save_file(tensors, path, metadata={k: meta[k] for k in order})
    return tensors


def _meta_keys(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return list(json.loads(f.read(n))["__metadata__"])


def test_any_metadata_order_gives_the_same_bytes(tmp_path):
    orders = [["format", HEADER_KEY, "z"], ["z", "format", HEADER_KEY], [HEADER_KEY, "z", "format"]]
    files = []
    for i, order in enumerate(orders * 3):                  # the writer's own order varies too
        path = str(tmp_path / f"{i}.safetensors")
        tensors = _write(path, order)
        sort_metadata(path)
        files.append(open(path, "rb").read())
        assert _meta_keys(path) == sorted(_meta_keys(path))
        assert verify_tensors(path)
        with safe_open(path, "pt") as f:
            assert f.metadata()["z"] == "1"
            for k, t in tensors.items():
                assert torch.equal(f.get_tensor(k), t)
    assert len(set(files)) == 1


def test_a_sorted_file_is_left_as_it_is(tmp_path):
    path = str(tmp_path / "a.safetensors")
    _write(path, ["format", HEADER_KEY, "z"])
    sort_metadata(path)
    before = open(path, "rb").read()
    sort_metadata(path)
    assert open(path, "rb").read() == before
