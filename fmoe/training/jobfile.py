"""A job file: ``fmoe train --config job.toml``, the job's settings as TOML.

The keys are the job settings' names, :class:`fmoe.training.JobConfig`'s fields (``--bias-rate``
is ``bias_rate``); flags given on the command line override the file, so a team keeps one file
per job and changes a run with a flag::

    # job.toml
    model = "qwen3_moe"
    preset = "tiny"
    nproc = 4
    ep = 4
    steps = 200
    lr = 3e-3
    out = "runs/qwen-ep4"

    $ fmoe train --config job.toml --lr 1e-3

Each value is checked as its flag's would be, and an unknown key names the file, the key and
the closest setting; nothing starts before the whole file is read. Python's ``tomllib`` reads
it (no dependency).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "job.toml")
    >>> _ = open(path, "w").write('model = "llama"\\nsteps = 5\\n')
    >>> read_job_file(path)
    {'model': 'llama', 'steps': 5}
"""

from __future__ import annotations

import difflib
import tomllib
from typing import Any

from .job import FIELDS, check_value

__all__ = ["read_job_file"]


def read_job_file(path: str) -> dict[str, Any]:
    """The settings of job file ``path`` (TOML; keys are :class:`JobConfig` field names).

    Args:
        path: the ``.toml`` file.
    Returns:
        setting name -> value, each checked like its flag.
    Raises:
        ValueError: naming ``--config``, the file and the problem (unreadable, not TOML, an
            unknown key with the closest setting, a table, or a value its setting refuses).
    """
    where = f"--config {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:                    # TOML is UTF-8 text
        raise ValueError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); TOML files "
                         "are UTF-8") from None
    settings = {}
    for key, value in data.items():
        if key not in FIELDS:
            close = difflib.get_close_matches(key.replace("-", "_"), list(FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: {key!r} is not a job setting{hint} (the keys are the settings' names: "
                             f"--bias-rate is bias_rate)")
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: {key} must be a single value, got a TOML {type(value).__name__}")
        try:
            settings[key] = check_value(key, value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return settings
