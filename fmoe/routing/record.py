"""Router replay: record the experts each token chose, then route by the record while the
weights are recomputed from the live logits (so router gradients still flow).

What RL fine-tuning needs for train / inference routing agreement (Megatron's "router
replay"): the rollout's routing decisions are replayed in the training forward. A record is
the sequence of a rank's router calls, in order (one call per MoE layer per forward; so
training steps x micro-batches x layers, evaluations included): :func:`recording` appends each
call's ``expert_ids [T, K]`` to a list, :func:`save_record` writes it as one safetensors file
(``uint8`` ids for up to 256 experts, else ``int16``/``int32``: compact, pickle-free), and
:func:`replay` answers the same sequence of calls with those ids. Replaying needs the same
sequence of calls as the recording (same steps, batch shapes, layers) and no recomputation in
backward (``remat`` would call the router again, out of order).

The weights are the router family's formula on the replayed ids (``scores``)::

    softmax       w = softmax(logits)[ids]           (then / sum if normalize)   topk
    sigmoid       w = sigmoid(logits)[ids]           (then / sum if normalize)   sigmoid_topk
    topk_softmax  w = softmax(logits[ids])                                       gpt-oss

times ``scale``: on the ids the live router chose, they are its weights and gradients.

Example:
    >>> import fmoe
    >>> calls, x = [], torch.randn(4, 8)
    >>> live = recording(fmoe.routing.topk(2), calls)(x)
    >>> again = replay(calls)(x)
    >>> torch.equal(again.expert_ids, live.expert_ids), torch.equal(again.weights, live.weights)
    (True, True)
"""

from __future__ import annotations

import os
from typing import Callable, Sequence, Union

import torch

from .core import Router, Routing, check_logits
from .inputs import call
from .state import state_of
from ..precision import upcast

__all__ = ["recording", "save_record", "load_record", "record_router", "scores_of", "replay", "record_writer",
           "REPLAY_SCORES", "KNOWN_SCORES"]

REPLAY_SCORES = ("softmax", "sigmoid", "topk_softmax")


def recording(router: Router, calls: list) -> Router:
    """``router`` that also appends each call's ``expert_ids`` (detached, on CPU) to ``calls``.

    Example:
        >>> import fmoe
        >>> calls = []
        >>> _ = recording(fmoe.routing.topk(1), calls)(torch.tensor([[0.0, 1.0]]))
        >>> calls
        [tensor([[1]])]
    """
    if not isinstance(calls, list):
        raise TypeError(f"recording: calls must be a list to append to, got {type(calls).__name__}")

    def wrapped(logits: torch.Tensor, **inputs) -> Routing:
        routing = call(router, logits, inputs)
        routing = routing if isinstance(routing, Routing) else Routing(*routing)
        calls.append(routing.expert_ids.detach().cpu())
        return routing

    wrapped.__name__ = f"recording({getattr(router, '__name__', 'router')})"
    wrapped.state = state_of(router)               # the wrapped router's state (fmoe.routing.state)
    return torch.compiler.disable(wrapped)   # eager under torch.compile: a traced list append recompiles each call


def _id_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32


#: the weights of the routers whose scores :func:`replay` recomputes, by ``--router`` name.
KNOWN_SCORES = {"topk": "softmax", "sigmoid_topk": "sigmoid", "topk_softmax": "topk_softmax"}


def scores_of(spec: str | None) -> str:
    """How a router's weights follow from its logits, for the record: a :data:`REPLAY_SCORES`
    formula, ``"default"`` (the model's own router, no ``--router``) or ``"own"`` (its own score
    function: capacity, expert choice, ReMoE, a user router: replay calls the router itself).

    Example:
        >>> scores_of("sigmoid_topk:k=2"), scores_of("switch:capacity_factor=1.0"), scores_of("mymod:router")
        ('sigmoid', 'own', 'own')
    """
    if not spec:
        return "default"
    head, _, rest = spec.partition(":")
    if head == "replay":
        return "own"
    return KNOWN_SCORES.get(head, "own") if "." not in head and head.isidentifier() and head.islower() else "own"


def save_record(calls: Sequence[torch.Tensor], path: Union[str, os.PathLike], num_experts: int | None = None,
                router: str | None = None) -> None:
    """Write a record (one ``[T, K]`` id tensor per router call) as a safetensors file, atomically,
    with the recording router's spec and score family (:func:`scores_of`) in its metadata.

    Args:
        calls: the ids, in call order (``-1``: an inactive slot).
        path: the file to write.
        num_experts: E (chooses the smallest id dtype; default: the largest recorded id + 1).
        router: the ``--router`` spec that chose them (None: the model's own router).
    """
    from safetensors.torch import save_file

    if num_experts is None:
        num_experts = 1 + max((int(c.max()) for c in calls if c.numel()), default=0)
    inactive = any(bool((c < 0).any()) for c in calls)
    dtype = torch.int16 if inactive and num_experts <= 32767 else _id_dtype(num_experts)   # -1 needs a sign
    tensors = {f"call.{i:09d}": ids.to(dtype).contiguous() for i, ids in enumerate(calls)}
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": "fmoe.routing.replay", "num_experts": str(num_experts),
                                      "router": router or "", "scores": scores_of(router)})
    os.replace(tmp, path)


def load_record(path: Union[str, os.PathLike]) -> list[torch.Tensor]:
    """The calls of a record file (int64 ids), in order."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise ValueError(f"replay: no routing record at {os.fspath(path)!r}")
    tensors = load_file(os.fspath(path))
    return [tensors[k].long() for k in sorted(tensors)]


def record_router(path: Union[str, os.PathLike]) -> tuple[str, str]:
    """``(router spec, scores)`` a record file was made with (``("", "softmax")`` for a record
    written before they were stored)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), "pt") as f:
        meta = f.metadata() or {}
    return meta.get("router", ""), meta.get("scores", "softmax")


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank-{rank}.safetensors") if os.path.isdir(path) else path


def replay(record: Union[str, os.PathLike, Sequence[torch.Tensor]], *, scores: str | None = None,
           normalize: bool = True, scale: float = 1.0, rank: int | None = None,
           resolve: Callable[[str], Router] | None = None) -> Router:
    """A router answering each call with the next recorded ids; weights from the live logits.

    A record holds the spec of the router that made it. A router whose weights follow from one of
    the formulas (``topk``, ``sigmoid_topk``, ``topk_softmax``, the model's own) is replayed by its
    formula; any other (capacity, expert choice, ReMoE, a user router: its own score function) is
    called itself, by its recorded spec, and its routing used where it chose the recorded experts
    (bitwise the live run, aux included); a call where it chose others is a ``ValueError`` naming
    it, as is ``scores`` naming another formula than the record's router.

    Args:
        record: a record directory (``--record-routing DIR``: this rank's ``rank-R.safetensors``),
            a record file, or the list of ids itself.
        scores: the weight formula (module docstring): ``softmax``, ``sigmoid`` or ``topk_softmax``
            (default: the record's router's, else softmax).
        normalize: rescale the k weights to sum to 1 (softmax / sigmoid).
        scale: multiply the weights.
        rank: which rank's file of a directory (default: ``$RANK``, else 0).
        resolve: ``resolve(spec) -> router``, how a recorded router with its own score function is
            rebuilt (``fmoe.routing.from_spec``; ``--router replay:...`` passes it).
    Returns:
        a router; a call past the end of the record, or of another shape, is a ValueError.

    Example:
        >>> r = replay([torch.tensor([[1]])], normalize=False)(torch.zeros(1, 4))
        >>> r.expert_ids.tolist(), r.weights.tolist()
        ([[1]], [[0.25]])
    """
    if scores is not None and scores not in REPLAY_SCORES:
        raise ValueError(f"replay: scores must be one of {REPLAY_SCORES}, got {scores!r}")
    spec, recorded = "", "default"
    if isinstance(record, (str, os.PathLike)):
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        path = _rank_file(os.fspath(record), rank)
        calls = load_record(path)
        spec, recorded = record_router(path)
    else:
        calls = [torch.as_tensor(c).long() for c in record]
    if scores is not None and recorded not in ("default", scores):
        raise ValueError(f"replay: the record was made by router {spec!r} "
                         f"({'its own score function' if recorded == 'own' else recorded + ' scores'}); replaying it with "
                         f"scores={scores!r} would train another router's model; drop scores= to replay {spec!r} itself")
    scores = scores or (recorded if recorded in REPLAY_SCORES else "softmax")
    own = None
    if recorded == "own":
        if resolve is None:
            raise ValueError(f"replay: the record was made by router {spec!r}, whose weights are its own score "
                             "function; replay calls it itself: pass resolve=fmoe.routing.from_spec")
        own = resolve(spec)
    position = [0]

    def router(logits: torch.Tensor, **inputs) -> Routing:
        i = position[0]
        if i >= len(calls):
            raise ValueError(f"replay: the record holds {len(calls)} router calls; this is call {i + 1} "
                             "(replay the same steps, batches and layers as the recording)")
        ids = calls[i].to(logits.device)
        check_logits(logits, ids.shape[1] if ids.ndim == 2 else 1)
        if ids.ndim != 2 or ids.shape[0] != logits.shape[0]:
            raise ValueError(f"replay: call {i + 1} recorded ids of shape {tuple(ids.shape)} for "
                             f"{logits.shape[0]} tokens; replay the same batches as the recording")
        position[0] = i + 1
        if own is not None:                     # the router's own score function: the router itself
            live = call(own, logits, inputs)
            live = live if isinstance(live, Routing) else Routing(*live)
            if not torch.equal(live.expert_ids, ids):
                raise ValueError(f"replay: call {i + 1}: the recorded router {spec!r} now chooses other experts than "
                                 "its record, and its weights are its own score function (no formula to reweight the "
                                 "recorded ones); replay its run on the same parameters and batches")
            return live
        if scores == "topk_softmax":
            weights = torch.softmax(upcast(logits).gather(1, ids), dim=-1)
        else:
            s = torch.softmax(upcast(logits), dim=-1) if scores == "softmax" else torch.sigmoid(upcast(logits))
            weights = s.gather(1, ids)                                             # [T, K]
            if normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scores == "sigmoid" else 0.0))
        return Routing(weights * scale, ids, {})

    router.state = state_of(own)            # a replayed router's state (e.g. ReMoE's) is the job's state too
    return torch.compiler.disable(router)    # eager under torch.compile: a traced call counter recompiles each call


def record_writer(calls: list, path: str, rank: int, router: str | None = None) -> Callable[[], None]:
    """``write()`` saving ``calls`` as rank ``rank``'s file of a record directory ``path``, made by
    the ``--router`` spec ``router`` (None: the model's own)."""
    def write() -> None:
        os.makedirs(path, exist_ok=True)
        save_record(calls, os.path.join(path, f"rank-{rank}.safetensors"), router=router)
    return write
