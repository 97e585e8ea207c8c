"""Training data: the Python standard library's source as a byte-level corpus.

Every machine that runs fmoe has CPython's ``.py`` files, so the default corpus needs no
download. Files are read in sorted path order and joined with a NUL separator; tokens are
bytes (ids 0..255, so any vocabulary >= 256 fits).

Batches are a pure function of ``(seed, step, batch_index)``: each row starts at an offset
drawn from a generator seeded with those three numbers. A resumed run therefore sees exactly
the batches the uninterrupted run would have seen, and the data position saved in a
checkpoint is just the step. Each data-parallel batch (``mesh.batch_index``) gets its own
rows; ranks of a TP group get the same rows.

Example:
    >>> corpus = Corpus.stdlib(max_bytes=100_000)
    >>> x, y = corpus.batch(step=1, batch_index=0, batch=2, seq=8, seed=0)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), True)
"""

from __future__ import annotations

import os
import sysconfig
from typing import Optional

import torch

__all__ = ["Corpus"]


class Corpus:
    """A 1-D uint8 token stream with deterministic batch sampling.

    Args:
        data: ``[N]`` uint8 tensor of tokens.
        name: description (for logs).
    """

    def __init__(self, data: torch.Tensor, name: str = "corpus"):
        if data.ndim != 1 or data.dtype != torch.uint8:
            raise TypeError("Corpus: data must be a 1-D uint8 tensor")
        self.data, self.name = data, name

    @classmethod
    def stdlib(cls, max_bytes: Optional[int] = 16_000_000) -> "Corpus":
        """The standard library's ``.py`` files (sorted paths), up to ``max_bytes`` bytes."""
        root = sysconfig.get_paths()["stdlib"]
        chunks, total = [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                with open(os.path.join(dirpath, fn), "rb") as f:
                    blob = f.read()
                chunks.append(blob + b"\0")
                total += len(chunks[-1])
                if max_bytes is not None and total >= max_bytes:
                    break
            if max_bytes is not None and total >= max_bytes:
                break
        if not chunks:
            raise FileNotFoundError(f"Corpus.stdlib: no .py files under {root}")
        raw = b"".join(chunks)[:max_bytes]
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8), f"python-stdlib:{root}")

    def __len__(self) -> int:
        return self.data.numel()

    def batch(self, step: int, batch_index: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets ``[batch, seq]`` (int64) for one data-parallel batch.

        Args:
            step: training step (from 1).
            batch_index: which data-parallel batch (``mesh.batch_index``).
            batch: rows per batch; seq: tokens per row.
            seed: data seed.
        Returns:
            ``(tokens, targets)``.
        """
        if seq + 1 > len(self):
            raise ValueError(f"Corpus.batch: seq={seq} needs at least {seq + 1} tokens, corpus has {len(self)}")
        g = torch.Generator().manual_seed(hash((int(seed), int(step), int(batch_index))) & 0x7FFF_FFFF_FFFF)
        starts = torch.randint(0, len(self) - seq - 1, (batch,), generator=g)
        rows = torch.stack([self.data[s: s + seq + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]
