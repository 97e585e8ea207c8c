"""Point-to-point exchanges between pipeline stages, differentiable: the pair that carries the
residual stream forward and its gradient back.

Stage ``s`` sends its output ``y`` to stage ``s + 1`` and receives, in backward, the gradient
of ``y`` from there; stage ``s + 1`` receives ``y`` as its input ``x`` and, in backward, sends
``dx`` to stage ``s``. Each side is one new-style ``torch.autograd.Function``:

function                      forward                            backward
``send_forward(y, peer)``     send ``y``; returns a 0-d token    receive ``dy`` (``y``'s shape)
``recv_forward(..., peer)``   receive ``x`` (shape, dtype given) send ``dx``

The token ``send_forward`` returns carries no value (it is zero): adding it to the stage's
scalar objective makes one ``torch.autograd.grad`` of that scalar run the whole stage's backward,
receiving ``dy`` first and sending ``dx`` last. ``recv_forward`` hangs off an ``anchor`` (an
empty tensor that requires grad, :meth:`Pipe.anchor`) so autograd has an input to reach it by:
its backward runs only when the anchor is among the inputs of ``torch.autograd.grad``.

Sends never block (``isend``): the :class:`Pipe` keeps each pending send with its buffer until
:meth:`Pipe.wait`; receives block. Any schedule whose order of sends and receives is the same
on both sides of each pair (the micro-batches in order) therefore cannot deadlock. Peers are
global ranks of the default group; ``tag`` keeps the micro-batches apart.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .counting import count_bytes

__all__ = ["Pipe", "send_forward", "recv_forward"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]    # what a stage's output may be
_MAX_DIMS = 6


class Pipe:
    """The pending sends of one step's pipeline exchanges (wait for them before the step ends);
    ``device``: where :func:`recv_forward` puts what it receives (the step's device).

    Example:
        >>> pipe = Pipe()
        >>> pipe.wait()                          # nothing pending
        >>> pipe.anchor().requires_grad
        True
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)   # of recv_forward's tensors
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.waited = 0.0                       # seconds spent in blocking receives and in wait()
        self._anchor = None

    def recv(self, shape: tuple, dtype: torch.dtype, device: torch.device, peer: int, tag: int) -> torch.Tensor:
        """Receive a tensor from global rank ``peer`` (blocking; the time counts in ``waited``)."""
        t0 = time.perf_counter()
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=peer, tag=tag)
        self.waited += time.perf_counter() - t0
        return buf

    def send(self, x: torch.Tensor, peer: int, tag: int) -> None:
        """Start sending ``x`` (contiguous copy kept until :meth:`wait`) to global rank ``peer``."""
        buf = x.detach().contiguous()
        count_bytes("send", buf.numel() * buf.element_size())
        self.pending.append((dist.isend(buf, dst=peer, tag=tag), buf))

    def wait(self) -> None:
        """Wait for every pending send."""
        t0 = time.perf_counter()
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        self.waited += time.perf_counter() - t0

    def send_tensor(self, x: torch.Tensor, peer: int, tag: int) -> None:
        """Send ``x`` with its dtype and shape (a fixed-size header first) to a receiver that does
        not know them (:meth:`recv_tensor`: evaluation under autocast)."""
        if x.ndim > _MAX_DIMS:
            raise ValueError(f"Pipe.send_tensor: at most {_MAX_DIMS} dims, got {tuple(x.shape)}")
        shape = list(x.shape) + [0] * (_MAX_DIMS - x.ndim)
        self.send(torch.tensor([_DTYPES.index(x.dtype), x.ndim, *shape], dtype=torch.int64, device=x.device), peer, tag)
        self.send(x, peer, tag)

    def recv_tensor(self, device: torch.device, peer: int, tag: int) -> torch.Tensor:
        """Receive what :meth:`send_tensor` sent."""
        head = self.recv((2 + _MAX_DIMS,), torch.int64, device, peer, tag).tolist()
        return self.recv(tuple(head[2:2 + head[1]]), _DTYPES[head[0]], device, peer, tag)

    def anchor(self) -> torch.Tensor:
        """The empty tensor that requires grad every :func:`recv_forward` of this pipe hangs off."""
        if self._anchor is None:
            self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        return self._anchor


class _SendForward(torch.autograd.Function):
    @staticmethod
    def forward(y, peer, tag, pipe):
        pipe.send(y, peer, 2 * tag)
        return y.new_zeros(())

    @staticmethod
    def setup_context(ctx, inputs, output):
        y, ctx.peer, ctx.tag, ctx.pipe = inputs
        ctx.shape, ctx.dtype, ctx.device = tuple(y.shape), y.dtype, y.device

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.pipe.recv(ctx.shape, ctx.dtype, ctx.device, ctx.peer, 2 * ctx.tag + 1), None, None, None


class _RecvForward(torch.autograd.Function):
    @staticmethod
    def forward(anchor, shape, dtype, peer, tag, pipe):
        return pipe.recv(shape, dtype, anchor.device, peer, 2 * tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        anchor, _, _, ctx.peer, ctx.tag, ctx.pipe = inputs
        ctx.anchor = anchor.new_zeros(anchor.shape)

    @staticmethod
    def backward(ctx, dx):
        ctx.pipe.send(dx, ctx.peer, 2 * ctx.tag + 1)
        return ctx.anchor, None, None, None, None, None     # the (empty) anchor's gradient: reached


def send_forward(y: torch.Tensor, peer: int, tag: int, pipe: Pipe) -> torch.Tensor:
    """Send ``y`` to global rank ``peer`` (the next stage); backward receives its gradient.

    Args:
        y: this stage's output (any shape; requires grad).
        peer: the next stage's rank at this rank's place.
        tag: the micro-batch (the receiver's :func:`recv_forward` names the same).
        pipe: the step's :class:`Pipe`.
    Returns:
        a 0-d zero token on ``y``'s graph: add it to the stage's objective.
    """
    return _SendForward.apply(y, peer, tag, pipe)


def recv_forward(shape: tuple, dtype: torch.dtype, peer: int, tag: int, pipe: Pipe) -> torch.Tensor:
    """Receive the previous stage's output from global rank ``peer``; backward sends its gradient.

    Args:
        shape, dtype: of the tensor the peer's :func:`send_forward` sends.
        peer: the previous stage's rank at this rank's place.
        tag: the micro-batch.
        pipe: the step's :class:`Pipe` (its :meth:`Pipe.anchor` must be an input of the
            ``torch.autograd.grad`` that runs this stage's backward).
    Returns:
        the received tensor, on the anchor's graph.
    """
    return _RecvForward.apply(pipe.anchor(), tuple(shape), dtype, peer, tag, pipe)
