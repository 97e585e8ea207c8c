"""``fmoe.train.run(**settings)``: the main job as a library call, with the CLI's settings.

``python -m fmoe.train --model deepseek_v3 --balance bias --bias-rate 1e-2 --out runs/a`` and
``fmoe.train.run(model="deepseek_v3", balance="bias", bias_rate=1e-2, out="runs/a")`` run the
same job: the keywords are the flags' names (``dest``: ``--bias-rate`` is ``bias_rate``), they
go through the same parser and checks (:func:`fmoe.train.parse.parse_args`: every usage error,
here a ``ValueError`` with the CLI's message, before anything starts) and the same launcher
(OUT lock, local ranks or torchrun's, checkpoints, ``OUT/log.jsonl``). A switch is ``True``;
``None`` or ``False`` leaves a flag out. The return value is rank 0's last log row (the CLI's
``{"final": ...}`` line).

A research loop that needs more than the flags passes ``step_config=`` (a
:class:`fmoe.training.step.StepConfig`): it replaces the one the flags would build (optimizer
settings, router, bias rate, ...). With ``nproc > 1`` it travels to the spawned ranks with
the settings (by cloudpickle, so a router defined in a notebook works). The model config's own
router-loss switch is off in the job (the flags' router carries the balance losses), so a
replacing router brings its own losses (:func:`fmoe.routing.with_losses`).

Example:
    >>> sorted(settings_argv(dict(model="qwen3_moe", steps=3, quiet=True)))
    ['--model', '--quiet', '--steps', '3', 'qwen3_moe']
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Mapping, Optional

__all__ = ["run", "settings_argv"]


def settings_argv(settings: Mapping[str, Any]) -> list[str]:
    """The command line of keyword ``settings`` (``TypeError`` naming an unknown one).

    Args:
        settings: flag dest -> value (``True`` for a switch; ``None`` / ``False``: left out).
    Returns:
        the argument list for :func:`fmoe.train.parse.parse_args`.
    """
    import argparse

    from .flags import build_parser

    actions = {a.dest: a for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    argv: list[str] = []
    for key, value in settings.items():
        if key not in actions:
            raise TypeError(f"fmoe.train.run: unknown setting {key!r}; settings are the flags of python -m "
                            f"fmoe.train by dest: {', '.join(sorted(actions))}")
        action = actions[key]
        if value is None or value is False:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if value is not True:
                raise TypeError(f"fmoe.train.run: {key} is a switch (True / False), got {value!r}")
            argv.append(action.option_strings[0])
            continue
        argv += [action.option_strings[0], str(value)]
    return argv


def run(*, step_config: Optional[Any] = None, **settings: Any) -> Optional[dict]:
    """Run ``python -m fmoe.train`` with these settings (see the module docstring).

    Args:
        step_config: a :class:`fmoe.training.step.StepConfig` replacing the flags' one (optional).
        **settings: the CLI's flags by dest (``model="qwen3_moe"``, ``nproc=4``, ``ep=4``, ...).
    Returns:
        rank 0's last log row (None on the other ranks under torchrun).
    Raises:
        ValueError: a usage error (the CLI's exit code 2), with the CLI's message.
        TypeError: an unknown setting.
    """
    from .cli import _train
    from .parse import parse_args
    from ..training.step import StepConfig

    argv = settings_argv(settings)
    if step_config is not None and not isinstance(step_config, StepConfig):
        raise TypeError(f"fmoe.train.run: step_config must be a fmoe.training.StepConfig, got "
                        f"{type(step_config).__name__}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args(argv)
    except SystemExit as e:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise ValueError(lines[-1] if lines else f"fmoe.train.run: usage error (exit {e.code})") from None
    args.step_config = step_config
    return _train(args)
