"""The main job end to end (``fmoe train``, in this process unless a launcher is tested): flags, log,
checkpoints, bitwise resume, resharded resume, torchrun."""

import os
import subprocess
import sys

import pytest
import torch

import fmoe
from fmoe.checkpoint import training as ckpt
from fmoe.fsdp import data_parallel_plan
from fmoe.optim.adamw import init as adamw_init
import fmoe.models.llama
from train_cases import read_log, train_cli

MODEL = "llama"
BASE = ["--model", MODEL, "--preset", "tiny", "--batch", "2", "--seq", "16", "--lr", "3e-3", "--quiet"]


def cli(*args, check=True):
    return train_cli(*args, check=check, timeout=600)


log = read_log


def load_params(path):
    model = fmoe.models.get(MODEL)
    cfg = model.preset("tiny", 1)                   # the config the CLI trained (vocab widened)
    params = model.init(cfg, seed=123)
    plan = data_parallel_plan(model.plan(cfg), params, fmoe.Mesh())
    ckpt.load(path, params, adamw_init(params), ckpt.packed_layout(plan, params))
    return params


@pytest.mark.parametrize("flags,match", [
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--steps", "x"], "--steps must be an integer >= 1, got 'x'"),
    (["--nproc", "4", "--tp", "3"], "--nproc 4 must be divisible by --tp * --dp-replicate = 3"),
    (["--nproc", "4", "--tp", "2", "--ep", "3"], "--ep 3 must be a multiple of --tp 2"),
    (["--nproc", "4", "--ep", "8"], "--ep 8 must divide fsdp * tp = 4 * 1 = 4 (the ranks of one data-parallel "
                                    "replica); valid --ep: 1, 2, 4"),
    (["--model", "gpt5"], "--model: unknown model 'gpt5'; fmoe.models has"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--resume", "/nonexistent/dir"], "--resume '/nonexistent/dir' does not exist"),
    (["--seed", str(2**70)], f"--seed must be an integer in [0, {2**63 - 1}], got {2**70}"),
    (["--seed", "-1"], f"--seed must be an integer in [0, {2**63 - 1}], got -1"),
])
def test_bad_flags_are_usage_errors(flags, match):
    out = cli(*flags, check=False)
    assert out.returncode == 2 and match in out.stderr and "usage:" in out.stderr


def test_log_checkpoints_and_resume(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    cli(*BASE, "--nproc", "2", "--steps", "12", "--save-every", "2", "--out", a)
    rows = log(a)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all({"loss", "tokens_per_s", "grad_norm", "lr"} <= set(r) for r in rows)
    assert rows[0]["tokens"] == 2 * 16 * 2                      # batch * seq * fsdp batches
    assert sorted(os.listdir(a)) == ["log.jsonl"] + sorted(f"step-{n}" for n in range(2, 13, 2))
    assert ckpt.latest(a).endswith("step-12")
    # same mesh: bitwise continuation
    cli(*BASE, "--nproc", "2", "--steps", "12", "--resume", os.path.join(a, "step-2"), "--out", b)
    assert [r["loss"] for r in log(b)] == [r["loss"] for r in rows[2:]]
    pa, pb = load_params(os.path.join(a, "step-12")), load_params(os.path.join(b, "step-12"))
    assert all(torch.equal(x, y) for x, y in zip(fmoe.tree.leaves(pa), fmoe.tree.leaves(pb)))
    fresh = fmoe.models.llama.init(fmoe.models.llama.MODEL.preset("tiny", 1), seed=0)
    assert not all(torch.equal(x, y) for x, y in zip(fmoe.tree.leaves(pa), fmoe.tree.leaves(fresh)))
    # another mesh (tp=2 on the same 2 ranks: one batch of twice the rows is NOT the same data,
    # so keep the batches: 2 ranks as fsdp=2 -> 4 ranks as tp=2, fsdp=2), resharded from the checkpoint
    cli(*BASE, "--nproc", "4", "--tp", "2", "--steps", "12", "--resume", a + "/step-2", "--out", c)
    got = torch.tensor([r["loss"] for r in log(c)])
    want = torch.tensor([r["loss"] for r in rows[2:]])
    assert len(got) == 10
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_init_from_hf_and_export_hf(tmp_path):
    """--init-hf starts from a transformers checkpoint (its loss at step 1 is the HF model's loss
    on that batch); --export-hf writes a checkpoint transformers loads."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fmoe.data import open_data
    from fmoe.models import qwen3_moe
    cfg = qwen3_moe.Config.tiny(vocab_size=256)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg.to_hf())).eval()
    hf.save_pretrained(tmp_path / "init")
    out, export = str(tmp_path / "run"), str(tmp_path / "export")
    cli("--model", "qwen3_moe", "--nproc", "2", "--ep", "2", "--steps", "2", "--batch", "2", "--seq", "16",
        "--aux-weight", "0", "--init-hf", str(tmp_path / "init"), "--export-hf", export, "--out", out, "--quiet")
    corpus = open_data(None).split(0.05)[0]                  # the training part (the tail is held out)
    parts = [corpus.batch(1, b, 2, 16, seed=0, num_batches=2) for b in range(2)]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(log(out)[0]["loss"] - want) <= 1e-5 * want
    again = Qwen3MoeForCausalLM.from_pretrained(export)
    before, after = hf.state_dict(), again.state_dict()
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)      # two steps were taken


def test_under_torchrun_it_uses_the_launchers_ranks(tmp_path):
    from fmoe.testing import free_port
    out = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), "-m", "fmoe", "train", *BASE, "--steps", "2",
                          "--out", out], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count('"final"') == 1
    rows = log(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["tokens"] == 2 * 16 * 2    # 2 launcher ranks = 2 batches


def test_in_process_job_leaves_no_spawn_marker_for_later_torchrun_children(tmp_path, monkeypatch):
    # A job run in-process with --nproc 2 marks its spawned ranks; the mark must not stay in this
    # process's environment, or a later torchrun child would take every rank for a spawned one
    # (each then locking OUT itself: RunDirBusy).
    from fmoe.cli.train import main

    monkeypatch.delenv("FMOE_SPAWNED", raising=False)
    assert main([*BASE, "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert "FMOE_SPAWNED" not in os.environ
    assert [r["step"] for r in log(str(tmp_path / "run"))] == [1]
