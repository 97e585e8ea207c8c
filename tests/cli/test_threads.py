"""--threads: the job's intra-op threads, chosen from the idle cores and the local ranks."""

import json
import os


from fmoe.training import threads
from train_cases import train_cli


def test_default_shares_the_idle_cores_over_the_local_ranks(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.default_threads(1, load=0.0) == 8
    assert threads.default_threads(4, load=0.0) == 2
    assert threads.default_threads(3, load=2.4) == 2          # 6 idle cores, 3 ranks
    assert threads.default_threads(1, load=7.6) == 1 and threads.default_threads(16, load=0.0) == 1
    assert threads.default_threads(2, load=50.0) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("FMOE_SPAWNED", raising=False)
    assert threads.local_ranks(1) == 4                          # torchrun's local ranks


def test_the_job_runs_with_the_threads_given(tmp_path):
    out = str(tmp_path / "o")
    train_cli("--model", "llama", "--steps", "1", "--batch", "2", "--seq", "16", "--threads", "1", "--quiet",
              "--out", out)
    assert json.load(open(os.path.join(out, "step-1", "meta.json")))["threads"] == 1
    bad = train_cli("--model", "llama", "--threads", "0", "--out", str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and "--threads must be an integer >= 1, got 0" in bad.stderr
