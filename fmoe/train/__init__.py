"""Training: data-parallel sharding (FSDP/efsdp/HSDP), the train step (AdamW from
:mod:`fmoe.optim`), the main job CLI (``python -m fmoe.train``) and resumable sharded checkpoints."""

from .step import StepConfig, train_step

__all__ = ["StepConfig", "train_step"]
