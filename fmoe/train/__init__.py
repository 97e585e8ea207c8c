"""Training: data-parallel sharding (FSDP/efsdp/HSDP), the main job CLI
(``python -m fmoe.train``). The train step, gradient reduction and evaluation are library
modules of :mod:`fmoe.training`; AdamW is :mod:`fmoe.optim`; sharded training checkpoints are
:mod:`fmoe.checkpoint.training`."""
