"""The main job as a typed config: :class:`JobConfig`, one frozen dataclass whose fields are the
flags of ``fmoe train`` (``--bias-rate`` is ``bias_rate``), checked when it is built.

``fmoe train --model deepseek_v3 --balance bias --bias-rate 1e-2 --out runs/a`` and
``fmoe.training.run(JobConfig(model="deepseek_v3", balance="bias", bias_rate=1e-2, out="runs/a"))``
run the same job: the program parses its command line into this class (its flags are made from
:data:`FIELDS`: name, group, help, metavar, choices) and calls :func:`fmoe.training.run`.

Each field's value is checked alone here (type, range, choices): a bad one is a ``ValueError``
naming the field as its flag (``--lr``), the value and what is valid. What needs more than one
field, the environment or the disk (the mesh over the launcher's world, ``--resume``'s checkpoint,
``OUT``) is checked by :func:`fmoe.training.resolve.resolve` before anything starts
(:class:`JobConfigError`).

``None`` is "not given": a setting a ``--resume`` keeps (:data:`fmoe.training.resume.KEPT`)
then takes the checkpoint's value, else its default (:data:`DEFAULTS`); so ``JobConfig().lr`` is
None and the job trains at ``DEFAULTS["lr"]``. The mesh fields (``nproc tp ep dp_replicate``) work
the same way, from the checkpoint's mesh record (:data:`fmoe.training.resume.MESH`).

Example:
    >>> JobConfig(model="qwen3_moe", nproc=4, ep=4).nproc
    4
    >>> JobConfig(bias_rate=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: --bias-rate must be a finite number >= 0, got -1.0
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Optional

import numpy

from ..model import PRESETS
from ..models import text_of
from .observe import check_tensorboard, parse_steps

__all__ = ["JobConfig", "JobConfigError", "FIELDS", "DEFAULTS", "DEFAULT_OUT", "SEED_MAX", "flag", "check_value"]

DEFAULT_OUT = "runs/fmoe"
SEED_MAX = 2**63 - 1   # torch.Generator.manual_seed takes 64-bit seeds; derived seeds wrap to 64 bits
PRECISIONS = ("fp32", "bf16")


class JobConfigError(ValueError):
    """The job's settings do not fit together, the environment or the disk (found before any
    rank starts or anything is written; the program's usage error, exit code 2)."""


def flag(name: str) -> str:
    """The flag of a field: ``bias_rate`` -> ``--bias-rate``."""
    return "--" + name.replace("_", "-")


# (check kind, argument): "int" (low, high or None), "float" (low, strict), "fraction" (open (0, 1)),
# "choice" (values), "model" (fmoe.models.text_of), "str" (a path-like as its text), "bool" (optional: a
# check of what switching it on needs), "steps" ("A:B"), "layers" ("3,2")
# Every field is None unless given ("not given" is how a --resume tells a setting to keep from one
# to change); ``default`` is the value the job uses then (:data:`DEFAULTS`).
def _f(group: str, check: tuple, help: str, default: Any = None, metavar: Optional[str] = None) -> Any:
    return dataclasses.field(default=None, metadata={"group": group, "check": check, "help": help,
                                                     "metavar": metavar, "default": default})


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The main job's settings (module docstring); every field is a flag of ``fmoe train``."""

    # model
    model: Optional[str] = _f("model", ("model",), "the model: a name of fmoe.models (shipped, registered or an "
                              "installed entry point; with --init-hf default: the checkpoint's model_type) or "
                              "module:attr, an import path to an fmoe.model.Model (in the library call, the Model "
                              "itself, recorded by its name)", metavar="NAME")
    preset: Optional[str] = _f("model", ("choice", PRESETS), "model size preset")
    init_hf: Optional[str] = _f("model", ("str",), "start from this Hugging Face checkpoint (config and weights; "
                                "weights cast to fp32 master weights) instead of a random --preset model", metavar="DIR")
    aux_weight: Optional[float] = _f("model", ("float", 0.0, False), "coefficient of the per-layer load-balance "
                                     "loss of MoE models (--balance aux / seq_aux / global_aux; 0: off) (default: 0.01)",
                                     metavar="X")
    balance: Optional[str] = _f("model", ("str",), "load-balancing methods of MoE models, from none, aux, seq_aux, "
                                "global_aux, z, bias (default: the model's own: aux for qwen3_moe/mixtral/gpt_oss, bias "
                                "for deepseek_v3)", metavar="M[,M]")
    z_weight: Optional[float] = _f("model", ("float", 0.0, False), "coefficient of the router z-loss (--balance z) "
                                   "(default: 0.001)", metavar="X")
    bias_rate: Optional[float] = _f("model", ("float", 0.0, False), "step of the expert-bias update after each step "
                                    "(--balance bias; 0: the bias stays frozen) (default: 0.001)", metavar="U")
    bias_update: Optional[str] = _f("model", ("choice", ("sign", "proportional")), "rule of the expert-bias update: "
                                    "sign(mean - load) or (mean - load) / mean (--balance bias) (default: sign)")
    record_routing: Optional[str] = _f("model", ("str",), "record every router call's expert ids (one safetensors "
                                       "file per rank, written at the end) for --router replay:record=DIR", metavar="DIR")
    upcycle: Optional[str] = _f("model", ("str",), "with --model mixtral --init-hf LLAMA_DIR: start from the dense "
                                "model, each MLP copied into E experts, top-K routing (fmoe.training.upcycle)",
                                metavar="E,K")
    impl: Optional[str] = _f("model", ("str",), "MoE dispatch implementation (a name registered in fmoe.ep)", "auto", "NAME")
    # mesh
    # (None: 1, or with --resume the checkpoint's mesh: fmoe.training.resume.MESH)
    nproc: Optional[int] = _f("mesh", ("int", 1, None), "local ranks to spawn (ignored under torchrun) (default: 1; "
                              "with --resume: the checkpoint's world)", metavar="N")
    tp: Optional[int] = _f("mesh", ("int", 1, None), "tensor-parallel size (default: 1; with --resume: the "
                           "checkpoint's)", metavar="N")
    ep: Optional[int] = _f("mesh", ("int", 1, None), "expert-parallel size (default: same as --tp; with --resume "
                           "and no --tp: the checkpoint's)", metavar="N")
    dp_replicate: Optional[int] = _f("mesh", ("int", 1, None), "data-parallel replicas (HSDP); fsdp = nproc / (pp * tp "
                                     "* dp_replicate) (default: 1; with --resume: the checkpoint's)", metavar="N")
    pp: Optional[int] = _f("mesh", ("int", 1, None), "pipeline stages (the outermost axis: stage s holds a contiguous block of "
                 "the decoder layers, the first also the embedding, the last the norm, head and loss; "
                 "fmoe.training.pipeline)", 1, "N")
    microbatches: Optional[int] = _f("mesh", ("int", 1, None), "micro-batches of each --batch that run through the "
                                     "pipeline (with --pp > 1; the same update as --grad-accum M) (default: --pp)",
                                     metavar="M")
    pp_layers: Optional[str] = _f("mesh", ("layers",), "decoder layers of each stage, e.g. 3,2 (the last stage also "
                                  "holds the head and the loss) (default: equal blocks; --pp must divide the layers)",
                                  metavar="N,N")
    pp_schedule: Optional[str] = _f("mesh", ("choice", ("1f1b", "gpipe")), "pipeline schedule: 1f1b (one forward, one backward: "
                          "at most pp micro-batches in flight) or gpipe (all forwards, then all backwards)", "1f1b")
    sp: Optional[bool] = _f("mesh", ("bool",), "sequence parallelism: between tensor-parallel blocks the residual stream, norms "
                  "and elementwise work are split over --tp on the sequence dimension (needs --tp > 1)", False)
    cp: Optional[int] = _f("mesh", ("int", 1, None), "context parallelism: each sequence split over N ranks in 2N "
                           "load-balanced causal chunks, K/V all-gathered for attention (fmoe.nn.context_parallel; "
                           "--seq divisible by 2N); nproc = pp * dp_replicate * fsdp * cp * tp", 1, "N")
    # data
    batch: Optional[int] = _f("data", ("int", 1, None), "sequences per data-parallel batch (default: 4)", metavar="N")
    seq: Optional[int] = _f("data", ("int", 1, None), "tokens per sequence (default: 64)", metavar="N")
    seed: Optional[int] = _f("data", ("int", 0, SEED_MAX), "seed of the initial weights and of the batches "
                             "(default: 0)", metavar="N")
    data: Optional[str] = _f("data", ("str",), "a .txt/.jsonl file, a directory of them, or a shard directory from "
                             "`fmoe data prepare` (default: the Python standard library's source, byte tokens)",
                             metavar="PATH")
    data_changed: Optional[bool] = _f("data", ("bool",), "with --resume: continue on a --data whose content differs "
                                      "from the corpus the checkpoint trained on (said on stderr and recorded; "
                                      "default: refused)", False)
    tokenizer: Optional[str] = _f("data", ("str",), "'bytes' or a Hugging Face tokenizer.json (file or directory) "
                                  "(default: bytes, or the tokenizer.json in --init-hf DIR)", metavar="T")
    eval_every: Optional[int] = _f("data", ("int", 0, None), "evaluate on the held-out split every N steps (0: never)", 0, "N")
    eval_batches: Optional[int] = _f("data", ("int", 1, None), "held-out batches per data-parallel rank", 4, "N")
    eval_fraction: Optional[float] = _f("data", ("fraction",), "tail of the data held out for evaluation "
                                        "(default: 0.05)", metavar="X")
    eval_seed: Optional[int] = _f("data", ("int", 0, SEED_MAX), "seed of the held-out batches, apart from --seed so runs of "
                        "different seeds evaluate on the same tokens", 0, "N")
    # optimization
    steps: Optional[int] = _f("optimization", ("int", 1, None), "train until this step (with --resume: the step to reach, "
                    "beyond the saved one)", 20, "N")
    lr: Optional[float] = _f("optimization", ("float", 0.0, True), "peak learning rate (linear warmup, then cosine "
                             "to 0.1 * lr at --steps) (default: 0.003)", metavar="X")
    warmup: Optional[int] = _f("optimization", ("int", 0, None), "warmup steps (default: 5)", metavar="N")
    weight_decay: Optional[float] = _f("optimization", ("float", 0.0, False), "AdamW decoupled weight decay "
                                       "(default: 0.1)", metavar="X")
    clip: Optional[float] = _f("optimization", ("float", 0.0, False), "global gradient-norm clip (default: 1.0; 0: "
                               "no clipping)", metavar="X")
    skip_nonfinite: Optional[int] = _f("optimization", ("int", 0, None), "skip up to N steps whose loss or gradient norm is "
                             "NaN/Inf (no update); one more stops the job. 0: the first one stops the job", 0, "N")
    grad_accum: Optional[int] = _f("optimization", ("int", 1, None), "micro-batches per step (each --batch rows) "
                                   "(default: 1)", metavar="N")
    dp_batches: Optional[int] = _f("optimization", ("int", 1, None), "one process reads exactly the batches of an N-rank "
                         "data-parallel run with the same other flags, each rank's batch as its own micro-batches, and "
                         "trains as that run does (--nproc 1 only; docs/routing-research.md)", 1, "N")
    optim_in_backward: Optional[bool] = _f("optimization", ("bool",), "update each layer's parameters as soon as their "
                                 "gradients are reduced in backward, so full gradients never coexist "
                                 "(fmoe.training.optim_backward)", False)
    loss_chunks: Optional[int] = _f("optimization", ("int", 1, None), "compute the loss by N chunks of tokens, each "
                          "recomputed in backward (no whole fp32 [tokens, vocab] log-softmax; fmoe.nn.chunked_loss)",
                          1, "N")
    router: Optional[str] = _f("optimization", ("str",), "NAME[:k=v,...] of fmoe.routing, or "
                               "module:function[:k=v,...] (default: the model's own router)", metavar="SPEC")
    router_changed: Optional[bool] = _f("optimization", ("bool",), "with --resume: train on with this --router instead "
                                        "of the checkpoint's, keeping its parameters and optimizer state (the new "
                                        "router recorded; default: refused)", False)
    # precision, devices, memory
    dtype: Optional[str] = _f("precision", ("choice", PRECISIONS), "compute dtype (autocast); the weights and "
                              "moments keep --master-dtype / --optim-dtype (default: fp32)")
    master_dtype: Optional[str] = _f("precision", ("choice", PRECISIONS), "dtype of the weights the optimizer "
                                     "updates (and their gradients and checkpoints); bf16 updates with stochastic "
                                     "rounding (fmoe.precision) (default: fp32)")
    optim_dtype: Optional[str] = _f("precision", ("choice", PRECISIONS), "dtype of AdamW's two moments "
                                    "(default: fp32)")
    device: Optional[str] = _f("precision", ("choice", ("auto", "cpu", "cuda")), "cuda: one GPU per local rank over NCCL; "
                     "auto: cuda when available", "auto")
    remat: Optional[str] = _f("precision", ("choice", ("none", "layer", "moe")), "recompute each layer / MoE block in "
                    "backward instead of keeping activations", "none")
    compile: Optional[bool] = _f("precision", ("bool",), "torch.compile the step: one process compiles forward + loss whole, a "
                       "multi-rank mesh each decoder layer once (the MoE exchange eager between the graphs; "
                       "docs/transforms.md). Same numbers as eager (default: eager)", False)
    memory_gb: Optional[float] = _f("precision", ("float", 0.0, True), "warn when the memory plan exceeds this "
                                    "per rank (default: no limit)", metavar="X")
    # checkpoints and output
    out: Optional[str] = _f("checkpoints and output", ("str",), "run directory: log.jsonl, step-N/ checkpoints, "
                            ".lock; a --resume without --out continues in the checkpoint's run directory "
                            f"(default: {DEFAULT_OUT})", metavar="DIR")
    save_every: Optional[int] = _f("checkpoints and output", ("int", 0, None), "checkpoint every N steps (0: only at the end)",
                         0, "N")
    profile_steps: Optional[str] = _f("checkpoints and output", ("steps",), "profile steps A to B with torch.profiler: "
                                      "a Chrome trace per rank in OUT/profile/rank-R.json", metavar="A:B")
    tensorboard: Optional[bool] = _f("checkpoints and output", ("bool", check_tensorboard), "also write the log rows as TensorBoard "
                           "scalars in OUT/tensorboard (needs pip install 'fmoe[tensorboard]')", False)
    keep_last: Optional[int] = _f("checkpoints and output", ("int", 0, None), "keep only the N newest complete checkpoints "
                        "in --out, removing older ones after each save (never the one --resume continues from; 0: "
                        "keep all)", 0, "N")
    resume: Optional[str] = _f("checkpoints and output", ("str",), "continue from a step-N checkpoint, or from the "
                               "latest one in a run directory (default: start a new run)", metavar="PATH")
    export_hf: Optional[str] = _f("checkpoints and output", ("str",), "write a Hugging Face checkpoint here at the "
                                  "end", metavar="DIR")
    overwrite: Optional[bool] = _f("checkpoints and output", ("bool",), "replace the previous run in --out (its log.jsonl and "
                         "step-N/ only; resuming an older checkpoint of --out: its newer checkpoints and log rows) and "
                         "let --export-hf replace checkpoint files in a directory holding other files (default: "
                         "refuse)", False)
    # runtime
    timeout: Optional[float] = _f("runtime", ("float", 0.0, True), "collective timeout, seconds", 1800.0, "X")
    threads: Optional[int] = _f("runtime", ("int", 1, None), "intra-op threads per rank (default: the usable cores "
                                "/ the local ranks, at least 1; fmoe.training.threads)", metavar="N")
    quiet: Optional[bool] = _f("runtime", ("bool",), "no progress bar (default: a progress bar on rank 0)", False)
    debug: Optional[bool] = _f("runtime", ("bool",), "print the full traceback of an error (default: one line)", False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = check_value(f.name, value)
                object.__setattr__(self, f.name, value)

    def get(self, name: str) -> Any:
        """The value the job uses: the field's, or :data:`DEFAULTS`' when it is None."""
        value = getattr(self, name)
        return DEFAULTS.get(name) if value is None else value


#: name -> dataclass field of every setting (its metadata: group, check, help, metavar, default)
FIELDS = {f.name: f for f in dataclasses.fields(JobConfig)}
#: the value a field left None takes (where it is not the checkpoint's on --resume): the fields' declared
#: defaults, and these
DEFAULTS: dict[str, Any] = {**{n: f.metadata["default"] for n, f in FIELDS.items() if f.metadata["default"] is not None},
                            **{"nproc": 1, "tp": 1, "dp_replicate": 1,
                               "model": "qwen3_moe", "preset": "tiny", "seed": 0, "batch": 4, "seq": 64, "lr": 3e-3,
                               "warmup": 5, "weight_decay": 0.1, "clip": 1.0, "eval_fraction": 0.05, "grad_accum": 1,
                               "dtype": "fp32", "master_dtype": "fp32", "optim_dtype": "fp32", "out": DEFAULT_OUT}}


def check_value(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as the job uses it (an int for a float field becomes a float).

    Raises:
        ValueError: not a value the field's flag accepts, naming the flag, the value and what is valid.
    """
    kind, *arg = FIELDS[name].metadata["check"]
    said = flag(name)
    # numpy's numbers count as numbers (not numpy's bools); a path-like as its text
    number = isinstance(value, numbers.Real) and not isinstance(value, (bool, numpy.bool_))
    if kind == "int":
        low, high = arg
        valid = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if not (number and isinstance(value, numbers.Integral)) or value < low or (high is not None and value > high):
            raise ValueError(f"{said} must be {valid}, got {value!r}")
        return int(value)
    if kind == "float":
        low, strict = arg
        valid = f"a finite number {'>' if strict else '>='} {low:g}"
        if not number or not math.isfinite(value) or value < low or (strict and value == low):
            raise ValueError(f"{said} must be {valid}, got {value!r}")
        return float(value)
    if kind == "fraction":
        if not number or not 0.0 < value < 1.0:
            raise ValueError(f"{said} must be in (0, 1), got {value!r}")
        return float(value)
    if kind == "choice":
        if value not in arg[0]:
            raise ValueError(f"{said} must be one of {', '.join(arg[0])}, got {value!r}")
        return value
    if kind == "model":                                # a name or module:attr, as text (a Model: its name)
        try:
            return text_of(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{said}: {e}") from None
    if kind == "steps":
        parse_steps(value, said)
        return value
    if kind == "bool":
        if not isinstance(value, (bool, numpy.bool_)):
            raise ValueError(f"{said} is a switch (True / False), got {value!r}")
        if value and arg:                              # a switch that needs an optional extra
            arg[0](said)
        return bool(value)
    if kind == "layers":                               # --pp-layers: ASCII digits only ('²' is a digit too)
        if not isinstance(value, str) or not re.fullmatch(r"\s*[1-9][0-9]*\s*(,\s*[1-9][0-9]*\s*)*", value):
            raise ValueError(f"{said} must be comma-separated layer counts >= 1, e.g. 3,2, got {value!r}")
        return value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{said} must be a non-empty string, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{said} must not hold a NUL byte, got {value!r}")
    return value
