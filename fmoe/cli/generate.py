"""``fmoe generate --ckpt DIR --prompt "..." [--nproc N --tp T --ep E]``: decode with :func:`fmoe.generate`.

``DIR`` is a Hugging Face checkpoint (``config.json`` + safetensors, e.g. written by
``fmoe train ... --export-hf DIR``; its ``model_type`` picks the model) or an fmoe
training checkpoint (``OUT/step-N`` or ``OUT``, its latest; ``meta.json`` names the model).
It decodes what was trained: the router recorded with the weights (``meta.json``'s ``router``,
or ``config.json``'s ``fmoe_router`` of an ``--export-hf``) is the one used; a recorded
``module:function`` router is code, which a checkpoint never chooses: pass it again as
``--router``; a ``--router`` other than the recorded one is refused. Prompts are text with the
checkpoint's tokenizer: its ``tokenizer.json``, or the one ``meta.json`` records (``--tokenizer
T`` when it is not there any more; it must be the same tokenizer), UTF-8 bytes for byte-level
runs (recorded as ``bytes``, or ``--bytes``), else whitespace-separated token ids (the output is
printed as ids). Every value read from the checkpoint is checked before anything is allocated
(config sizes, the cache for ``--max-new-tokens``), and non-finite weights are refused. Rank 0 prints one line per
prompt (``--json``: one JSON object per prompt with ``prompt``, ``ids``, ``text``).

With ``--nproc N`` it spawns N local gloo ranks (under ``torchrun`` it uses the launcher's
ranks); every rank loads its own slices (``--tp``, ``--ep``) and decodes the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from ..models import get, hf_model, recorded
from ..training.job import check_value


def build_parser() -> argparse.ArgumentParser:
    """The flag parser (``--help`` shows every default)."""
    ap = argparse.ArgumentParser(prog="fmoe generate", description="Generate text with an fmoe model.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="HF checkpoint dir, or a training checkpoint (OUT or OUT/step-N)")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eos-id", type=int, default=None)
    ap.add_argument("--bytes", action="store_true", help="prompts and output as UTF-8 bytes (byte-level models)")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt")
    ap.add_argument("--nproc", type=int, default=1, help="local ranks to spawn")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=None, help="default: tp")
    ap.add_argument("--impl", default="auto", help="MoE dispatch implementation")
    ap.add_argument("--model", default=None, metavar="NAME", help="the model, a name of fmoe.models or module:attr: "
                    "needed for a training checkpoint of a model fmoe does not ship (code is never imported from a "
                    "checkpoint; it must name the recorded model) or an HF checkpoint whose model_type is not registered")
    ap.add_argument("--router", default=None, help="only to pass again a module:function router the checkpoint "
                    "records (code is never imported from a checkpoint)")
    ap.add_argument("--tokenizer", default=None, help="the checkpoint's tokenizer.json when the recorded one is "
                    "not there any more (must be the same tokenizer)")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the flags (usage error, exit code 2, on a bad value)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("nproc", "tp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.ep is not None and args.ep < 1:
        ap.error(f"--ep must be >= 1, got {args.ep}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.temperature < float("inf"):
        ap.error(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.max_new_tokens < 0:
        ap.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    try:                                  # the job's own rule: a 64-bit seed
        check_value("seed", args.seed)
    except ValueError as e:
        ap.error(str(e))
    if not os.path.isdir(args.ckpt):
        ap.error(f"--ckpt {args.ckpt!r} is not a directory")
    from ..mesh import check_layout

    launched = "WORLD_SIZE" in os.environ
    try:                              # the mesh's own rules, before any rank starts
        check_layout(int(os.environ["WORLD_SIZE"]) if launched else args.nproc, tp=args.tp, ep=args.ep,
                     names={"tp": "--tp", "ep": "--ep", "world": "WORLD_SIZE" if launched else "--nproc"})
    except ValueError as e:
        ap.error(str(e))
    try:                              # the model, before any rank starts: no code a checkpoint names
        args.declared = _choose_model(args.ckpt, args.model)
    except (ValueError, TypeError) as e:
        ap.error(f"--model: {e}" if args.model is not None and "--model" not in str(e) else str(e))
    return args


def _choose_model(ckpt: str, given: Optional[str]) -> Any:
    """The model of ``ckpt``: an HF checkpoint's ``model_type`` through the registry
    (:func:`fmoe.models.hf_model`), a training checkpoint's recorded model (:func:`fmoe.models.recorded`),
    or None when the checkpoint cannot be read yet (:func:`load` reports it)."""
    from fmoe.checkpoint import training as tckpt

    if os.path.isfile(os.path.join(ckpt, "config.json")):
        return get(hf_model(ckpt, given))
    step = tckpt.latest(ckpt)
    try:
        meta = tckpt.read_meta(step) if step is not None else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        return None if given is None else get(given)
    return recorded(meta.get("model"), given, os.path.join(step, "meta.json"))


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: cannot read it as JSON ({e})") from None


def _router(recorded: Any, given: Optional[str], file: str) -> Optional[Any]:
    """The router to decode with: the recorded one (re-validated; code only when passed again)."""
    from fmoe.routing.spec import from_spec, parse_spec

    if recorded is not None and not isinstance(recorded, str):
        raise ValueError(f"{file}: the recorded router {recorded!r} is not a NAME[:k=v,...] string")
    if given is not None and given != recorded:
        raise ValueError(f"--router {given!r}: the checkpoint was trained with router {recorded or 'of the model'!r} "
                         f"({file}); decoding with another router is another model. Drop --router")
    if recorded is None:
        return None
    module, _, _ = parse_spec(recorded)
    if module != "fmoe.routing" and given is None:
        raise ValueError(f"{file}: the recorded router {recorded!r} is code from module {module!r}; a checkpoint "
                         f"never chooses code to run. If you trust it, pass --router {recorded}")
    return from_spec(recorded, "--router")


def _tokenizer(recorded: Optional[str], digest: Optional[str], given: Optional[str], file: str) -> Optional[Any]:
    """The recorded tokenizer (``--tokenizer`` when it is gone; it must have the recorded digest)."""
    from fmoe.data import load_tokenizer

    if given is None and recorded is not None and recorded != "bytes" and not os.path.isfile(recorded):
        raise ValueError(f"{file}: the run's tokenizer {recorded!r} is not there any more; pass --tokenizer T "
                         "(the same tokenizer.json)")
    spec = given if given is not None else recorded
    if spec is None:
        return None
    tok = load_tokenizer(spec)
    if digest is not None and tok.digest != digest:
        raise ValueError(f"tokenizer {tok.name!r} ({tok.digest}) is not the one the run used ({recorded!r}, {digest}; "
                         f"{file})")
    return tok


def _check_finite(params: Any, ckpt: str) -> None:
    import torch

    from fmoe.sharding import local_shard
    from fmoe.tree import flatten

    for path, t in flatten(params).items():
        local = local_shard(t)
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            raise ValueError(f"--ckpt {ckpt!r}: parameter {path!r} holds NaN/Inf values; refusing to generate "
                             "from broken weights")


def load(ckpt: str, mesh: Any, args: Optional[argparse.Namespace] = None) -> tuple[Any, Any, Any, Any, Any]:
    """``(model, params, cfg, router, tokenizer)`` from an HF or a training checkpoint directory
    (router None: the model's own; tokenizer None: the checkpoint records none)."""
    import fmoe
    from fmoe.checkpoint.config_check import config_from_dict

    given_router = getattr(args, "router", None)
    given_tok = getattr(args, "tokenizer", None)
    declared = getattr(args, "declared", None)        # chosen by parse_args before the ranks started
    config_file = os.path.join(ckpt, "config.json")
    if os.path.isfile(config_file):
        config = _read_json(config_file)
        model = declared or get(hf_model(ckpt))     # a checkpoint's model_type is the registry name
        params, cfg = model.load_hf(ckpt, mesh=mesh if mesh.world > 1 else None)
        _check_finite(params, ckpt)
        record_file = os.path.join(ckpt, "fmoe.json")
        record = _read_json(record_file) if os.path.isfile(record_file) else {}
        record = record if isinstance(record, dict) else {}
        router = _router(config.get("fmoe_router"), given_router, config_file)
        if os.path.isfile(os.path.join(ckpt, "tokenizer.json")) and given_tok is None:
            tok = _tokenizer(os.path.join(ckpt, "tokenizer.json"), record.get("tokenizer_digest"), None, record_file)
        else:
            tok = _tokenizer(record.get("tokenizer") if record.get("tokenizer") == "bytes" else None,
                             record.get("tokenizer_digest"), given_tok, record_file)
        return model, params, cfg, router, tok
    from fmoe.checkpoint import training as tckpt

    step = tckpt.latest(ckpt)
    if step is None:
        raise ValueError(f"--ckpt {ckpt!r} holds neither config.json (HF checkpoint) nor a complete step-N "
                         "training checkpoint")
    meta = tckpt.read_meta(step)
    file = os.path.join(step, "meta.json")
    model = declared or recorded(meta.get("model"), None, file)
    if "hf_config" not in meta:
        raise ValueError(f"{file}: no 'hf_config' (the model config); not written by fmoe train")
    cfg = config_from_dict(model, meta["hf_config"], f"{file} 'hf_config'", fits=True)
    router = _router(meta.get("router"), given_router, file)
    tok = _tokenizer(meta.get("tokenizer"), meta.get("tokenizer_digest"), given_tok, file)
    full = model.init(cfg)
    plan = model.build_plan(cfg, mesh=mesh, params=full, data_parallel=True)
    params = fmoe.shard(full, plan, mesh)
    tckpt.load(step, params, None, tckpt.packed_layout(plan, full))   # weights only: checksums, finite values
    return model, params, cfg, router, tok


def _codec(args: argparse.Namespace, tok: Any):
    """``(encode(str) -> ids, decode(ids) -> str or None)``."""
    if args.bytes or getattr(tok, "name", None) == "bytes":
        return (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace"))
    if tok is not None:
        return tok.encode_prompt, tok.decode

    def ids_of(s: str) -> list:
        try:
            return [int(t) for t in s.split()]
        except ValueError:
            raise ValueError(f"--prompt {s!r}: the checkpoint has no tokenizer, so a prompt is whitespace-separated "
                             "token ids (or pass --bytes for a byte-level model)") from None
    return ids_of, (lambda ids: None)


def run(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Load and generate on this rank; returns one dict per prompt."""
    import threading

    from tqdm import tqdm

    import fmoe

    # tqdm's default lock holds a multiprocessing semaphore, which a spawned rank leaves for the
    # resource tracker to report as leaked: one thread lock per rank (as the training ranks do)
    tqdm.set_lock(threading.RLock())

    mesh = fmoe.Mesh(tp=args.tp, ep=args.ep)
    model, params, cfg, router, tok = load(args.ckpt, mesh, args)
    encode, decode = _codec(args, tok)
    prompts = [encode(p) for p in args.prompt]
    out = fmoe.generate(model, params, cfg, prompts, args.max_new_tokens, mesh=mesh if world > 1 else None,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_id=args.eos_id,
                        impl=args.impl, router=router)
    S = max(map(len, prompts))
    rows = []
    for p, ids, row in zip(args.prompt, prompts, out.tolist()):
        new = row[S:]
        rows.append({"prompt": p, "ids": ids + new, "text": decode(ids + new)})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; prints on rank 0 and returns the exit code."""
    args = parse_args(argv)
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            import torch.distributed as dist

            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            owned = world > 1 and not dist.is_initialized()
            if owned:
                dist.init_process_group("gloo")
            try:
                rows = run(rank, world, args)
                if owned:
                    from fmoe.collectives import barrier

                    barrier()
            finally:
                if owned and dist.is_initialized():        # not left to the interpreter's teardown
                    dist.destroy_process_group()
            if rank != 0:
                return 0
        elif args.nproc == 1:
            rows = run(0, 1, args)
        else:
            from fmoe import launch

            rows = launch.run(run, args.nproc, args, timeout=1800)[0]
    except (ValueError, TypeError) as e:
        print(f"fmoe generate: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"fmoe generate: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 1
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(r["text"] if r["text"] is not None else " ".join(map(str, r["ids"])))
    return 0

