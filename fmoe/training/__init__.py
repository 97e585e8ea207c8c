"""The training library: one pure train step, data-parallel gradient reduction and held-out
evaluation, importable without the ``python -m fmoe.train`` command line."""

from .evaluate import evaluate
from .grads import reduce_grads
from .step import StepConfig, train_step

__all__ = ["StepConfig", "train_step", "reduce_grads", "evaluate"]
