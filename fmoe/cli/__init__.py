"""The programs: ``fmoe <command>`` (the console script) = ``python -m fmoe <command>``.

Each command is one module here that parses its command line into the library's objects (a
:class:`fmoe.training.JobConfig`, a checkpoint path and prompts, ...), holds a lock where it
writes, starts ranks where it runs on several, and reports (one line per error, exit codes).
Nothing of the library imports this package; no library package has a ``__main__``.

Example:
    >>> sorted(COMMANDS)
    ['data', 'generate', 'memory', 'plot', 'train']
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

__all__ = ["COMMANDS", "main"]

#: command -> what it does (its module is ``fmoe.cli.<command>``)
COMMANDS = {
    "train": "train a model on local gloo ranks or under torchrun (the main job)",
    "generate": "generate text from a Hugging Face or a training checkpoint",
    "memory": "per-rank memory and traffic of a training job before running it (--dry-run: measured on fake tensors)",
    "data": "tokenize text files into memmap shards (fmoe data prepare)",
    "plot": "training curves of one or several runs",
}


def usage() -> str:
    """``fmoe --help``: the commands."""
    from .. import __version__

    lines = [f"usage: fmoe <command> [options]     (python -m fmoe <command> is the same program; fmoe {__version__})",
             "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "fmoe <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``fmoe <command> ...``; returns the exit code (2: no or an unknown command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"{usage()}\n\nfmoe: error: unknown command {args[0]!r}; choose from {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"fmoe.cli.{args[0]}").main(args[1:])
