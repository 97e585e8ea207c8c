"""A token stream and its batches: a pure function of ``(seed, step, batch index)``.

A :class:`TokenStream` is a sequence of token ids held as one or more 1-D numpy arrays — in
memory, or ``numpy.memmap`` views of pre-tokenized shard files (nothing is read until a batch
needs it). Documents are concatenated, separated by the tokenizer's end-of-text id.

Sampling. A step of a data-parallel job consumes ``num_batches`` batches (``mesh.num_batches``);
batch ``b`` reads only its own contiguous slice ``[b N / num_batches, (b + 1) N / num_batches)``
of the stream, so the batches of different ranks are disjoint. Inside its slice a batch's rows
start at offsets drawn from a generator seeded by ``(seed, step, b)``: a resumed run sees exactly
the batches the uninterrupted run would have seen, and the data position saved in a checkpoint is
just the step. Ranks of a TP group share a batch index and so read the same rows.

Held-out split: :meth:`TokenStream.split` cuts the last ``fraction`` of the tokens off as the
evaluation stream (the same cut for on-the-fly tokenization and shards, so both give the same
batches).

Example:
    >>> import numpy as np
    >>> s = TokenStream([np.arange(100, dtype=np.uint16)])
    >>> x, y = s.batch(step=1, batch_index=1, batch=2, seq=8, seed=0, num_batches=2)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all()), bool((x >= 50).all())
    (torch.Size([2, 8]), True, True)
"""

from __future__ import annotations

import bisect
from typing import Sequence, Union

import numpy as np
import torch

__all__ = ["TokenStream"]


def _seed(seed: int, step: int, batch_index: int) -> int:
    """Generator seed of one batch (Python's hash of an int tuple is the same in every process)."""
    return hash((int(seed), int(step), int(batch_index))) & 0x7FFF_FFFF_FFFF


class TokenStream:
    """Token ids in one or more 1-D integer arrays, read as one stream.

    Args:
        parts: 1-D numpy arrays (or memmaps, or torch tensors) of unsigned integer ids.
        name: description for logs.
        vocab_size: size of the vocabulary the ids come from (None: unknown).
    """

    def __init__(self, parts: Union[Sequence, np.ndarray, torch.Tensor], name: str = "tokens",
                 vocab_size: int | None = None):
        if isinstance(parts, (np.ndarray, torch.Tensor)):
            parts = [parts]
        arrays = []
        for i, p in enumerate(parts):
            a = p.numpy() if isinstance(p, torch.Tensor) else p
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "ui":
                raise TypeError(f"TokenStream: part {i} must be a 1-D integer array, got "
                                f"{getattr(a, 'dtype', type(a))} with shape {getattr(a, 'shape', None)}")
            if len(a):
                arrays.append(a)
        self.parts, self.name, self.vocab_size = arrays, name, vocab_size
        self._starts = [0]
        for a in arrays:
            self._starts.append(self._starts[-1] + len(a))

    @classmethod
    def stdlib(cls, max_bytes: int | None = 16_000_000) -> "TokenStream":
        """The Python standard library's source as byte tokens (:func:`fmoe.data.sources.stdlib_bytes`)."""
        from .sources import stdlib_bytes

        raw, root = stdlib_bytes(max_bytes)
        return cls([np.frombuffer(raw, dtype=np.uint8)], f"python-stdlib:{root}", vocab_size=256)

    def __len__(self) -> int:
        return self._starts[-1]

    def tokens(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Ids ``[start, stop)`` of the stream as one int64 array (reads across parts)."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"TokenStream.tokens: [{start}, {stop}) is outside [0, {len(self)})")
        out, i = [], max(0, bisect.bisect_right(self._starts, start) - 1)
        while start < stop:
            a, lo = self.parts[i], self._starts[i]
            take = min(stop, lo + len(a))
            out.append(np.asarray(a[start - lo: take - lo], dtype=np.int64))
            start, i = take, i + 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def view(self, start: int, stop: int) -> "TokenStream":
        """The sub-stream ``[start, stop)`` (no copy of memmapped data)."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"TokenStream.view: [{start}, {stop}) is outside [0, {len(self)})")
        parts = []
        for a, lo in zip(self.parts, self._starts):
            a0, a1 = max(start, lo) - lo, min(stop, lo + len(a)) - lo
            if a1 > a0:
                parts.append(a[a0:a1])
        return TokenStream(parts, f"{self.name}[{start}:{stop}]", self.vocab_size)

    def split(self, fraction: float) -> tuple["TokenStream", "TokenStream"]:
        """``(train, held_out)``: the held-out stream is the last ``fraction`` of the tokens.

        Example:
            >>> t, e = TokenStream([np.arange(100, dtype=np.uint8)]).split(0.1)
            >>> len(t), len(e), int(e.tokens()[0])
            (90, 10, 90)
        """
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"TokenStream.split: fraction must be in (0, 1), got {fraction!r}")
        cut = len(self) - int(round(len(self) * fraction))
        return self.view(0, cut), self.view(cut, len(self))

    def batch(self, step: int, batch_index: int, batch: int, seq: int, seed: int,
              num_batches: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets ``[batch, seq]`` (int64) of one data-parallel batch.

        Args:
            step: training step (from 1), or the index of an evaluation batch.
            batch_index: which data-parallel batch (``mesh.batch_index``), ``< num_batches``.
            batch: rows per batch; seq: tokens per row.
            seed: data seed.
            num_batches: data-parallel batches per step (``mesh.num_batches``); batch
                ``batch_index`` reads only its own ``1 / num_batches`` slice of the stream.
                None: every batch index samples the whole stream (batches may overlap).
        Returns:
            ``(tokens, targets)``.
        """
        for name, v in (("batch", batch), ("seq", seq), ("num_batches", 1 if num_batches is None else num_batches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TokenStream.batch: {name} must be an int >= 1, got {v!r}")
        if batch_index < 0 or (num_batches is not None and batch_index >= num_batches):
            raise ValueError(f"TokenStream.batch: batch_index={batch_index} must be in [0, {num_batches})")
        self.check_rows(seq, num_batches)
        lo, hi = 0, len(self)
        if num_batches is not None:
            lo, hi = len(self) * batch_index // num_batches, len(self) * (batch_index + 1) // num_batches
        g = torch.Generator().manual_seed(_seed(seed, step, batch_index))
        starts = torch.randint(lo, hi - seq - 1, (batch,), generator=g)
        rows = torch.from_numpy(np.stack([self.tokens(s, s + seq + 1) for s in starts.tolist()]))
        return rows[:, :-1], rows[:, 1:]

    def check_rows(self, seq: int, num_batches: int | None = None) -> None:
        """Raise ``ValueError`` unless each of ``num_batches`` data-parallel batches (None: 1) has
        a row of ``seq`` tokens to draw from: ``seq + 2`` tokens in its slice (:meth:`batch`'s rule).

        Example:
            >>> s = TokenStream(np.arange(40, dtype=np.uint8), "forty")
            >>> s.check_rows(18, 2)
            >>> s.check_rows(19, 2)
            Traceback (most recent call last):
            ...
            ValueError: TokenStream.batch: forty has 40 tokens, 20 per data-parallel batch (2 batches); seq=19 needs at least 21 per batch
        """
        per = len(self) // (num_batches or 1)              # the smallest slice of :meth:`batch`
        if per < seq + 2:
            raise ValueError(f"TokenStream.batch: {self.name} has {len(self)} tokens, "
                             f"{per} per data-parallel batch ({num_batches or 1} batches); seq={seq} needs "
                             f"at least {seq + 2} per batch")

    def union(self, step: int, batch: int, seq: int, seed: int, num_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``num_batches`` data-parallel batches of a step, stacked in batch-index order
        (``[num_batches * batch, seq]``): what an ``num_batches``-rank run reads, in one process
        (``--dp-batches``). Each rank's rows stay contiguous, so ``chunk(num_batches)`` gives
        them back.

        Example:
            >>> s = TokenStream(np.arange(1000, dtype=np.uint16), "digits")
            >>> x, _ = s.union(1, 2, 4, 0, num_batches=2)
            >>> torch.equal(x[2:], s.batch(1, 1, 2, 4, 0, num_batches=2)[0])
            True
        """
        parts = [self.batch(step, b, batch, seq, seed, num_batches=num_batches) for b in range(num_batches)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
