"""Two torchrun launchers on localhost as two "nodes" (``--nnodes 2 --nproc-per-node 2``): nodes
started with different settings are refused on both before the first step, naming the setting
(fmoe.training.settings); a SIGKILLed torchrun takes its ranks with it (parent-death signal) and
the other node ends soon after, not at a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from fmoe.launch import free_port

BASE = ["--model", "llama", "--preset", "tiny", "--batch", "2", "--seq", "16", "--quiet"]


def _node(rank: int, port: int, args: list, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "fmoe", "train", *BASE, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _two_nodes(args0: list, args1: list, timeout: float = 300) -> tuple[list, float]:
    port = free_port()
    start = time.monotonic()
    nodes = [_node(0, port, args0), _node(1, port, args1)]
    outs = [p.communicate(timeout=timeout) for p in nodes]
    return [(p.returncode, out, err) for p, (out, err) in zip(nodes, outs)], time.monotonic() - start


def _errors(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("fmoe train: error:")]


def test_different_lr_is_refused_on_both_nodes_naming_lr(tmp_path):
    out = str(tmp_path / "run")
    res, _ = _two_nodes(["--out", out, "--steps", "2", "--lr", "0.003"], ["--out", out, "--steps", "2", "--lr", "0.03"])
    for code, stdout, err in res:
        assert code != 0 and '"final"' not in stdout, err[-3000:]
        lines = _errors(err)
        assert len(lines) == 1, err[-3000:]                          # once per node, not once per rank
        assert "SettingsMismatch" in lines[0] and "lr: rank 0-1 0.003, rank 2-3 0.03" in lines[0]
    assert not os.path.exists(os.path.join(out, "log.jsonl"))          # no step was taken


def test_different_steps_is_refused_in_seconds_not_at_the_timeout(tmp_path):
    out = str(tmp_path / "run")
    res, took = _two_nodes(["--out", out, "--steps", "10"], ["--out", out, "--steps", "12"])
    for code, _, err in res:
        assert code != 0
        assert any("steps: rank 0-1 10, rank 2-3 12" in line for line in _errors(err)), err[-3000:]
    assert took < 120, took                                  # start-up only (--timeout is 1800 s)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_one_torchrun_leaves_no_rank_of_it_alive(tmp_path):
    out = str(tmp_path / "run")
    args = ["--out", out, "--steps", "100000", "--timeout", "600"]
    port = free_port()
    nodes = [_node(0, port, args), _node(1, port, args)]
    started: list = []                                       # every rank, to end them if the test fails
    try:
        log = os.path.join(out, "log.jsonl")
        deadline = time.monotonic() + 240
        while not (os.path.exists(log) and os.path.getsize(log)):     # training has started
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), \
                [p.communicate()[1][-2000:] for p in nodes if p.poll() is not None]
            time.sleep(0.5)
        ranks = _children(nodes[1].pid)
        started += ranks + _children(nodes[0].pid)
        assert len(ranks) == 2, ranks
        nodes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while any(_alive(r) for r in ranks) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not any(_alive(r) for r in ranks), "ranks of the killed torchrun still run"
        rows = sum(1 for _ in open(log))
        code = nodes[0].wait(timeout=60)                    # the other node ends too, soon
        ended = time.monotonic() - killed
        assert code != 0
        lines = _errors(nodes[0].communicate()[1])
        assert len(lines) == 1 and "a peer rank ended without reporting an error" in lines[0], lines   # once
        print(f"node 0 ended {ended:.1f} s after the kill")
        assert sum(1 for _ in open(log)) <= rows + 1         # no training went on after the kill
        assert [json.loads(r)["step"] for r in open(log)][0] == 1
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for r in started:                                   # orphans would hold the pipes open
            if _alive(r):
                os.kill(r, signal.SIGKILL)
        for p in nodes:
            p.communicate(timeout=30)
