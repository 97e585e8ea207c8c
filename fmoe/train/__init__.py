"""Training: data-parallel sharding (FSDP/efsdp/HSDP), functional AdamW, the main job CLI
(``python -m fmoe.train``) and resumable sharded checkpoints. The train step, gradient
reduction and evaluation are library modules of :mod:`fmoe.training`."""

from .optim import AdamWConfig, adamw_init, adamw_update, global_norm, lr_at

__all__ = ["AdamWConfig", "adamw_init", "adamw_update", "global_norm", "lr_at"]
