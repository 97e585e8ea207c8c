"""Resumable sharded training checkpoints: ``OUT/step-N/`` via ``torch.distributed.checkpoint``.

A checkpoint holds the parameters, the optimizer state, the step (which is also the data
position: batches are a pure function of the step) and the job's config. Every rank writes its
own shards (DCP), so saving never gathers a model, and loading on another mesh reshards: DCP
reads, for each destination shard, exactly the overlapping pieces of the saved shards.

What a checkpoint may contain, and nothing else is read: ``shard-*.safetensors`` files (torch's
``HuggingFaceStorageWriter``: tensors plus JSON sharding offsets in the safetensors header) and
``meta.json`` (plain JSON: step, job config, and a SHA-256 per shard file). Loading uses
``HuggingFaceStorageReader``, which builds DCP's metadata from those JSON headers: nothing is
unpickled, so a crafted checkpoint cannot run code. Before reading, every ``.safetensors`` file
must be listed in ``meta.json`` and match its checksum (safetensors itself has none), and after
reading every value must be finite; nothing non-finite is written either (:func:`save` checks
the state first, :func:`first_nonfinite`). Any other file (a planted ``.metadata`` pickle, say) is
never opened. A directory in torch's pickle-based format (``meta.json`` without this format,
``.metadata``, ``*.distcp``) is refused.

Packed placements (a fused ``[gate | up]`` weight split per block) are not contiguous chunks of
the full tensor, which DCP cannot describe; such a leaf is stored as one tensor per block
(``path.__block0``, ``path.__block1``), each a plain chunked shard, so it reshards like any other
— also to and from a single process, where the same leaf is a plain tensor.

Atomicity: the one mechanism of :mod:`fmoe.checkpoint.atomic`. Rank 0 makes the temporary
directory ``OUT/.step-N.tmp-<pid>-<random>`` (:func:`~fmoe.checkpoint.atomic.begin`) and tells
every rank its name; all ranks write into it; after a barrier rank 0 writes ``meta.json`` and
swaps it into ``OUT/step-N`` (:func:`~fmoe.checkpoint.atomic.commit`: a rename, or an atomic
exchange with a previous ``step-N``). A save that fails on any rank (a full disk, say) removes
its temporary directory on the way out; a process killed mid-save leaves it behind, which
:func:`latest` never picks and the next save (or the next job holding ``OUT``'s lock) removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import tree as _tree
from . import atomic
from .canonical import sort_metadata
from .errors import io_error
from .finite import NonFiniteState, first_nonfinite
from .integrity import digests, verify
from .retention import complete_steps
from .packed import dcp_view, restore, saved_paths, views
from .progress import bar
from .steps import step_dir, step_of
from ..collectives import all_gather_objects, barrier, broadcast_object

__all__ = ["save", "load", "saved_paths", "latest", "read_meta", "packed_layout", "on_rank0", "FORMAT"]

FORMAT = "fmoe-train-safetensors/1"   # meta.json "format" of this layout

def _own(name: str) -> bool:
    """The files a training checkpoint consists of (a re-save of ``step-N`` replaces only those)."""
    return name == "meta.json" or name.endswith(".safetensors")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def packed_layout(plan: Any, params: Any, mesh: Any = None) -> dict[str, tuple[int, int]]:
    """``{path: (blocks, dim)}`` of every packed leaf under ``plan`` (mesh-independent)."""
    out = {}
    for path, p in _tree.flatten(plan.resolve(params, mesh)).items():
        if p.packed > 1:
            out[path] = (p.packed, p.packed_dim)
    return out


@contextlib.contextmanager
def _single_process_ok():
    """Silence DCP's "assuming the intent is to save/load in a single process" (it is). Only
    then: ``catch_warnings`` resets the once-per-location registry of every warning."""
    if _dist():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _agree(error: Optional[str]) -> Optional[str]:
    """The first rank's error message (or None), the same on every rank (one all-gather)."""
    if not _dist() or dist.get_world_size() == 1:
        return error
    return next((e for e in all_gather_objects(error) if e is not None), None)


def on_rank0(fn: Callable[[], Any], what: str) -> None:
    """Run ``fn`` on rank 0; every rank raises if it failed (rank 0 its own exception)."""
    error: Optional[BaseException] = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn it
            error = io_error(e, what)
    msg = _agree(None if error is None else str(error))
    if error is not None:
        raise error
    if msg is not None:
        raise RuntimeError(f"rank 0 failed {what}: {msg}")


def _split_digests(directory: str) -> dict[str, dict]:
    """Checksums of every file in ``directory``, each rank hashing its share of the files after
    sorting their header metadata (:mod:`fmoe.checkpoint.canonical`: byte-reproducible files)."""
    names = sorted(os.listdir(directory))
    world, rank = (dist.get_world_size(), dist.get_rank()) if _dist() else (1, 0)
    for name in names[rank::world]:
        if name.endswith(".safetensors"):
            sort_metadata(os.path.join(directory, name))
    mine = digests(directory, names[rank::world])
    if world == 1:
        return mine
    return {k: v for part in all_gather_objects(mine) for k, v in part.items()}


def save(out_dir: str, step: int, params: Any, opt_state: Any, meta: dict,
         packed: Optional[dict] = None, progress: bool = False) -> str:
    """Write ``out_dir/step-{step}`` atomically; call on every rank. Returns the final path.

    Args:
        out_dir: the run directory.
        step: steps done.
        params, opt_state: trees to save (any placements).
        meta: JSON-able job description (config, mesh, data settings).
        packed: :func:`packed_layout` of the params (leaves stored as blocks).
        progress: a bar on stderr (:mod:`fmoe.checkpoint.progress`; the job's rank 0 without --quiet).
    Raises:
        NonFiniteState: a parameter or moment holds NaN/Inf (checked before anything is written,
            naming the first such leaf; on every rank).
        OSError: disk full (``"no space left on device writing OUT/step-N"``) or read-only
            ``out_dir``, on every rank; RuntimeError for other failures of any rank.
    """
    packed = packed or {}
    final = step_dir(out_dir, step)
    what = f"writing {final}"
    box: dict = {}
    path = first_nonfinite(_state(params, opt_state))      # nothing non-finite is ever saved
    bad = _agree(None if path is None else f"rank {_rank()}: {path!r}")
    if bad is not None:
        good = latest(out_dir) if os.path.isdir(out_dir) else None
        raise NonFiniteState(f"step {step}: the training state holds non-finite values (NaN/Inf; first: {bad}); "
                             f"{final} was not written (last good checkpoint: {good or 'none'}). Try a lower --lr")

    def prepare() -> None:
        os.makedirs(out_dir, exist_ok=True)
        box["tmp"] = atomic.begin(final, own=_own)

    on_rank0(prepare, what)
    tmp = broadcast_object(box.get("tmp"), src=0)
    try:
        with bar(f"saving {final}", ["write", "checksums", "commit"], progress) as next_part:
            try:
                writer = dcp.HuggingFaceStorageWriter(tmp, save_distributed=True)
                with _single_process_ok():
                    dcp.save(views(params, opt_state, packed), storage_writer=writer, no_dist=not _dist())
            except (Exception, dcp.api.CheckpointException) as e:
                raise io_error(e, what) from e
            barrier()
            next_part()
            files = _split_digests(tmp)
            next_part()

            def commit() -> None:
                fd = os.open(os.path.join(tmp, "meta.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "w") as f:
                    json.dump({**meta, "step": step, "format": FORMAT, "files": files}, f, indent=2, sort_keys=True)
                atomic.commit(tmp, final, own=_own)

            on_rank0(commit, what)
            next_part()
    except BaseException:
        if _rank() == 0:
            atomic.abort(tmp)             # a failed save leaves nothing behind (the disk stays usable)
        raise
    return final


def latest(path: str) -> Optional[str]:
    """``path`` itself if it is a complete ``step-N`` checkpoint, else the complete ``step-N``
    with the largest N inside it (None if there is none). Temporary directories of unfinished
    saves and symbolic links are never picked."""
    if os.path.isfile(os.path.join(path, "meta.json")) and step_of(os.path.basename(os.path.normpath(path))) is not None:
        return path
    if not os.path.isdir(path):
        return None
    steps = complete_steps(path)
    return os.path.join(path, steps[-1][1]) if steps else None


def read_meta(ckpt: str) -> dict:
    """The checked ``meta.json`` of a complete checkpoint.

    Raises:
        ValueError: naming the path, when there is no ``meta.json`` (or it is a symbolic link),
        it is not a JSON object,
        its ``step`` is not a non-negative int, or the directory is in torch's pickle-based
        format (which fmoe refuses to read).
    """
    file = os.path.join(ckpt, "meta.json")
    if os.path.islink(file):                    # as a shard link is: nothing is read from outside
        raise ValueError(f"{file} is a symbolic link (to {os.readlink(file)!r}); a checkpoint's files are its own")
    if not os.path.isfile(file):
        raise ValueError(f"{ckpt!r} is not a complete fmoe training checkpoint (no meta.json)")
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{file}: 'step' must be a non-negative integer, got {step!r}")
    if meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise ValueError(f"{file}: format {meta.get('format')!r} is not {FORMAT!r}; this checkpoint was "
                         "written in torch's pickle-based DCP format (.metadata/.distcp), which fmoe does "
                         "not load because unpickling a file can run arbitrary code")
    return meta


def _check_files(ckpt: str, meta: dict) -> None:
    """Every tensor file is listed in meta.json and matches its SHA-256 (ranks share the work)."""
    record = os.path.join(ckpt, "meta.json")
    names = sorted(n for n in os.listdir(ckpt) if n != "meta.json")
    error = None
    unlisted = [n for n in names if n not in meta["files"] and n.endswith(".safetensors")]
    if unlisted:                 # the reader would read these: only the files fmoe wrote may be there
        error = (f"{ckpt}: {unlisted[:5]} not listed in {record}; a checkpoint holds only the tensor "
                 "files fmoe wrote (refusing to read it)")
    else:
        world, rank = (dist.get_world_size(), dist.get_rank()) if _dist() else (1, 0)
        try:
            verify(ckpt, meta["files"], record, sorted(meta["files"])[rank::world])
        except ValueError as e:
            error = str(e)
    error = _agree(error)
    if error is not None:
        raise ValueError(error)


def _state(params: Any, opt_state: Optional[Any]) -> dict:
    """What a checkpoint holds of the state (the step counter is an integer)."""
    return {"params": params} if opt_state is None else {"params": params, "m": opt_state["m"], "v": opt_state["v"]}


def _check_finite(tree: Any, ckpt: str) -> None:
    path = first_nonfinite(tree)
    bad = _agree(None if path is None else f"{ckpt}: {path!r} holds non-finite values (NaN/Inf); resume from an "
                 "earlier step")
    if bad is not None:
        raise ValueError(bad)


def load(ckpt: str, params: Any, opt_state: Optional[Any], packed: Optional[dict] = None,
         progress: bool = False, fresh: Sequence[str] = ()) -> dict:
    """Load a checkpoint into ``params`` and ``opt_state`` in place (any mesh: DCP reshards);
    call on every rank with the same ``packed`` layout as the save. Returns the meta.
    ``opt_state=None`` reads the parameters only (decoding needs no optimizer state). ``fresh``: leaves
    the checkpoint lacks (a new router's state), kept as they are, moments too.

    Nothing is unpickled; the files are checked against ``meta.json``'s checksums first and the
    loaded values must be finite (``ValueError`` naming the file or the leaf otherwise).
    ``progress``: a bar on stderr (:mod:`fmoe.checkpoint.progress`).
    """
    with bar(f"loading {ckpt}", ["checksums", "read", "check"], progress) as next_part:
        meta = read_meta(ckpt)
        _check_files(ckpt, meta)
        next_part()
        packed = packed or {}
        state = views(params, opt_state, packed, fresh) if opt_state is not None else {"params": dcp_view(params, packed, fresh)}
        try:
            with torch.no_grad(), _single_process_ok():
                dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(ckpt), no_dist=not _dist())
                if opt_state is not None:
                    opt_state["step"].copy_(state["opt"]["step"])
        except (Exception, dcp.api.CheckpointException) as e:
            raise io_error(e, f"reading {ckpt}") from e
        next_part()
        restore(params, state["params"], packed)
        if opt_state is not None:
            restore(opt_state["m"], state["opt"]["m"], packed)
            restore(opt_state["v"], state["opt"]["v"], packed)
        _check_finite(_state(params, opt_state), ckpt)
        next_part()
    return meta
