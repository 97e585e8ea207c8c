"""The training library: the main job as a typed config and one call (:class:`JobConfig`,
:func:`run`), one pure train step, data-parallel gradient reduction and held-out evaluation.
The program ``fmoe train`` parses its command line into a :class:`JobConfig` and calls
:func:`run`; nothing here reads a command line."""

from .evaluate import evaluate
from .grads import reduce_grads
from .job import JobConfig, JobConfigError
from .resolve import resolve
from .runner import run
from .step import StepConfig, train_step

__all__ = ["JobConfig", "JobConfigError", "run", "resolve", "StepConfig", "train_step", "reduce_grads", "evaluate"]
