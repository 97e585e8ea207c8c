"""Training: data-parallel sharding (FSDP/efsdp/HSDP), functional AdamW, the train step, the
main job CLI (``python -m fmoe.train``, or :func:`run` with the same settings as keywords) and
resumable sharded checkpoints."""

from .optim import AdamWConfig, adamw_init, adamw_update, global_norm, lr_at
from .step import StepConfig, train_step
from .api import run

__all__ = ["AdamWConfig", "adamw_init", "adamw_update", "global_norm", "lr_at", "StepConfig", "train_step", "run"]
