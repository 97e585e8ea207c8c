"""Progress of the job's checkpoint save, load and Hugging Face export (fmoe.checkpoint.progress):
a bar on rank 0's stderr naming what is saved, loaded or exported; none with --quiet."""

from __future__ import annotations

import os

import pytest

from train_cases import train_cli

BASE = ["--model", "llama", "--preset", "tiny", "--batch", "2", "--seq", "16", "--nproc", "2"]


def stderr_of(capfd, *args) -> str:
    """``fmoe train *args`` in this process; what it and its ranks wrote to stderr (rank 0 of the
    spawned ranks writes to the caller's file descriptor 2, which ``capfd`` captures)."""
    capfd.readouterr()
    return train_cli(*args).stderr + capfd.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_save_load_and_export_show_a_bar_unless_quiet(tmp_path, quiet, capfd):
    out, export, again = (str(tmp_path / n) for n in ("run", "hf", "hf2"))
    flags = ["--quiet"] if quiet else []
    first = stderr_of(capfd, *BASE, *flags, "--steps", "2", "--out", out, "--export-hf", export)
    resumed = stderr_of(capfd, "--resume", out, *flags, "--steps", "3", "--export-hf", again)
    texts = {f"saving {os.path.join(out, 'step-2')}": first, f"exporting {export}": first,
             f"loading {os.path.join(out, 'step-2')}": resumed,
             f"saving {os.path.join(out, 'step-3')}": resumed}
    for text, stderr in texts.items():
        assert (text in stderr) != quiet, (text, stderr[-2000:])
    if not quiet:                                  # the bar counts its parts: the export's one file
        assert "1/1" in first.split(f"exporting {export}")[-1]
