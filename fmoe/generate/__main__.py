"""``python -m fmoe.generate --ckpt DIR --prompt "..." [--nproc N --tp T --ep E]``.

``DIR`` is a Hugging Face checkpoint (``config.json`` + safetensors, e.g. written by
``python -m fmoe.train ... --export-hf DIR``; its ``model_type`` picks the model) or an fmoe
training checkpoint (``OUT/step-N`` or ``OUT``, its latest; ``meta.json`` names the model).
Prompts are text when the checkpoint directory holds a ``tokenizer.json`` (the output is decoded
back to text), UTF-8 bytes with ``--bytes`` (models trained on fmoe's byte corpus), else
whitespace-separated token ids (the output is printed as ids). Rank 0 prints one line per
prompt (``--json``: one JSON object per prompt with ``prompt``, ``ids``, ``text``).

With ``--nproc N`` it spawns N local gloo ranks (under ``torchrun`` it uses the launcher's
ranks); every rank loads its own slices (``--tp``, ``--ep``) and decodes the same prompts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Optional, Sequence

MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss", "llama": "llama",
               "deepseek_v3": "deepseek_v3"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fmoe.generate", description="Generate text with an fmoe model.")
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
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.max_new_tokens < 0:
        ap.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not os.path.isdir(args.ckpt):
        ap.error(f"--ckpt {args.ckpt!r} is not a directory")
    from ..mesh import check_layout

    launched = "WORLD_SIZE" in os.environ
    try:                              # the mesh's own rules, before any rank starts
        check_layout(int(os.environ["WORLD_SIZE"]) if launched else args.nproc, tp=args.tp, ep=args.ep,
                     names={"tp": "--tp", "ep": "--ep", "world": "WORLD_SIZE" if launched else "--nproc"})
    except ValueError as e:
        ap.error(str(e))
    return args


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def load(ckpt: str, mesh: Any) -> tuple[Any, Any, Any, Optional[str]]:
    """``(model, params, cfg, tokenizer_dir)`` from an HF or a training checkpoint directory."""
    import fmoe

    if os.path.isfile(os.path.join(ckpt, "config.json")):
        with open(os.path.join(ckpt, "config.json")) as f:
            kind = json.load(f).get("model_type")
        if kind not in MODEL_TYPES:
            raise ValueError(f"--ckpt {ckpt!r}: model_type {kind!r} is not supported; supported: {sorted(MODEL_TYPES)}")
        model = importlib.import_module(f"fmoe.models.{MODEL_TYPES[kind]}")
        params, cfg = model.load_hf(ckpt, mesh=mesh if mesh.world > 1 else None)
        return model, params, cfg, ckpt
    from fmoe.train import ckpt as tckpt
    from fmoe.model import model_of
    from fmoe.train.optim import adamw_init

    step = tckpt.latest(ckpt)
    if step is None:
        raise ValueError(f"--ckpt {ckpt!r} holds neither config.json (HF checkpoint) nor a complete step-N "
                         "training checkpoint")
    meta = tckpt.read_meta(step)
    model = importlib.import_module(f"fmoe.models.{meta['model']}")
    cfg = model.Config(**{k: _tuples(v) for k, v in meta["config"].items()})
    full = model.init(cfg)
    plan = model_of(model).build_plan(cfg, mesh=mesh, params=full, data_parallel=True)
    params = fmoe.shard(full, plan, mesh)
    tckpt.load(step, params, adamw_init(params), tckpt.packed_layout(plan, full))
    return model, params, cfg, None


def _codec(args: argparse.Namespace, tok_dir: Optional[str]):
    """``(encode(str) -> ids, decode(ids) -> str or None)``."""
    if args.bytes:
        return (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace"))
    path = os.path.join(tok_dir, "tokenizer.json") if tok_dir else None
    if path and os.path.isfile(path):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return (lambda s: tok.encode(s).ids), (lambda ids: tok.decode(ids))

    def ids_of(s: str) -> list:
        try:
            return [int(t) for t in s.split()]
        except ValueError:
            raise ValueError(f"--prompt {s!r}: the checkpoint has no tokenizer.json, so a prompt is whitespace-separated "
                             "token ids (or pass --bytes for a byte-level model)") from None
    return ids_of, (lambda ids: None)


def run(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Load and generate on this rank; returns one dict per prompt."""
    import fmoe

    mesh = fmoe.Mesh(tp=args.tp, ep=args.ep)
    model, params, cfg, tok_dir = load(args.ckpt, mesh)
    encode, decode = _codec(args, tok_dir)
    prompts = [encode(p) for p in args.prompt]
    out = fmoe.generate(model, params, cfg, prompts, args.max_new_tokens, mesh=mesh if world > 1 else None,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_id=args.eos_id,
                        impl=args.impl)
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
            if world > 1 and not dist.is_initialized():
                dist.init_process_group("gloo")
            rows = run(rank, world, args)
            if rank != 0:
                return 0
        elif args.nproc == 1:
            rows = run(0, 1, args)
        else:
            from fmoe import launch

            rows = launch.run(run, args.nproc, args, timeout=1800)[0]
    except (ValueError, TypeError) as e:
        print(f"fmoe.generate: error: {e}", file=sys.stderr)
        return 1
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(r["text"] if r["text"] is not None else " ".join(map(str, r["ids"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
