"""The main job on your own data: text + a BPE tokenizer, shards, eval, resume, bf16, routers.

Each run is a real ``fmoe train`` on 2 or 4 local gloo ranks.
"""

import json
import os
import sys

import pytest

from train_cases import read_log, train_cli

BASE = ["--model", "qwen3_moe", "--preset", "tiny", "--batch", "2", "--seq", "32", "--lr", "1e-2", "--warmup", "2",
        "--quiet"]


cli, log = train_cli, read_log


def meta(out_dir, step):
    with open(os.path.join(out_dir, f"step-{step}", "meta.json")) as f:
        return json.load(f)


def test_text_and_tokenizer_train_eval_shards_and_resume(corpus, tmp_path):
    root, d, tok = corpus
    a, b, c = (str(tmp_path / n) for n in "abc")
    flags = [*BASE, "--nproc", "2", "--ep", "2", "--tokenizer", tok, "--eval-every", "4", "--eval-batches", "2"]
    cli(*flags, "--data", d, "--steps", "12", "--out", a, "--export-hf", str(tmp_path / "hf"))
    rows = log(a)
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses                # it learns
    evals = [(r["step"], r["eval_loss"], r["eval_ppl"]) for r in rows if "eval_loss" in r]
    assert [s for s, _, _ in evals] == [4, 8, 12] and evals[-1][1] < evals[0][1]
    assert all(abs(p - 2.718281828 ** e) < 1e-3 * p for _, e, p in evals)
    m = meta(a, 12)
    assert m["tokenizer"].endswith("tokenizer.json") and m["config"]["vocab_size"] == 320   # 300 -> x64
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "hf"))
    # the same job from pre-tokenized shards: identical batches, hence identical losses
    shards = str(tmp_path / "shards")
    from fmoe.cli.data import main as data_main       # fmoe data prepare, in this process
    assert data_main(["prepare", "--tokenizer", tok, "--out", shards, "--quiet", "--shard-tokens", "3000", d]) == 0
    cli(*flags, "--data", shards, "--steps", "12", "--save-every", "6", "--out", b)
    assert [r["loss"] for r in log(b)] == losses and [r.get("eval_loss") for r in log(b)] == [r.get("eval_loss") for r in rows]
    # resume from step 6 continues the same data stream bitwise
    cli(*flags, "--data", shards, "--steps", "12", "--resume", os.path.join(b, "step-6"), "--out", c)
    assert [r["loss"] for r in log(c)] == losses[6:]


def test_init_hf_uses_its_tokenizer_or_refuses_byte_ids(corpus, tmp_path):
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fmoe.models import qwen3_moe
    root, d, tok = corpus
    cfg = qwen3_moe.Config.tiny(vocab_size=320)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg.to_hf())).save_pretrained(tmp_path / "hf")
    flags = [*BASE, "--nproc", "1", "--steps", "1", "--data", d, "--init-hf", str(tmp_path / "hf")]
    r = cli(*flags, "--out", str(tmp_path / "a"), check=False)
    assert r.returncode != 0 and "has no tokenizer.json and a vocabulary of 320" in r.stderr
    cli(*flags, "--tokenizer", "bytes", "--out", str(tmp_path / "b"))              # explicit: allowed
    assert meta(str(tmp_path / "b"), 1)["tokenizer"] == "bytes"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok, f), tmp_path / "hf" / f)
    cli(*flags, "--out", str(tmp_path / "c"))                                       # found in DIR
    assert meta(str(tmp_path / "c"), 1)["tokenizer"] == str(tmp_path / "hf" / "tokenizer.json")


def test_bf16_on_four_ranks_resumes_bitwise_with_fp32_masters(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    flags = [*BASE, "--nproc", "4", "--tp", "2", "--ep", "4", "--dtype", "bf16", "--steps", "4"]
    cli(*flags, "--save-every", "2", "--out", a)
    cli(*flags, "--resume", os.path.join(a, "step-2"), "--out", b)
    assert [r["loss"] for r in log(b)] == [r["loss"] for r in log(a)][2:]
    assert meta(a, 4)["dtype"] == "bf16"
    import torch

    import fmoe
    from fmoe.models import qwen3_moe
    from fmoe.checkpoint import training as ckpt
    from fmoe.fsdp import data_parallel_plan
    from fmoe.optim.adamw import init as adamw_init
    cfg = qwen3_moe.MODEL.preset("tiny", 1)
    params = qwen3_moe.init(cfg, seed=1)
    state = adamw_init(params)
    ckpt.load(os.path.join(a, "step-4"), params, state,
              ckpt.packed_layout(data_parallel_plan(qwen3_moe.plan(cfg), params, fmoe.Mesh()), params))
    leaves = fmoe.tree.leaves(params) + fmoe.tree.leaves(state["m"]) + fmoe.tree.leaves(state["v"])
    assert {t.dtype for t in leaves} == {torch.float32}                          # fp32 masters and moments saved
    assert not torch.equal(params["embed"], qwen3_moe.init(cfg, seed=1)["embed"])


def test_remat_grad_accum_and_routers_from_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "my_routers.py").write_text(
        "import torch\nfrom fmoe.routing import Routing\n\n"
        "def top1(logits):\n"
        "    w, ids = torch.softmax(logits.float(), -1).max(-1, keepdim=True)\n"
        "    return Routing(w, ids, {})\n")
    # the user's module on the path (as PYTHONPATH puts it there): the job's ranks take the caller's sys.path
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_routers", raising=False)
    runs = {"plain": [], "remat": ["--remat", "layer", "--grad-accum", "2", "--batch", "1"],
            "sigmoid": ["--router", "sigmoid_topk:k=2"], "user": ["--router", "my_routers:top1"]}
    for name, extra in runs.items():
        cli(*BASE, "--nproc", "2", "--ep", "2", "--steps", "3", "--aux-weight", "0", *extra,
            "--out", str(tmp_path / name))
    sys.modules.pop("my_routers", None)           # the next test's tmp_path holds another module
    plain, remat = log(str(tmp_path / "plain")), log(str(tmp_path / "remat"))
    assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"] for x, y in zip(plain, remat))   # 2 x 1 rows = 2 rows
    assert meta(str(tmp_path / "remat"), 3)["remat"] == "layer" and meta(str(tmp_path / "remat"), 3)["settings"]["grad_accum"] == 2
    for name, spec in (("sigmoid", "sigmoid_topk:k=2"), ("user", "my_routers:top1")):
        rows = log(str(tmp_path / name))
        assert meta(str(tmp_path / name), 3)["router"] == spec and len(rows) == 3
        assert rows[-1]["loss"] < rows[0]["loss"] and rows[0]["loss"] != plain[0]["loss"]
    user = log(str(tmp_path / "user"))
    assert all(sum(layer) == 2 * 32 * 2 for layer in user[0]["expert_load"])       # top-1: one slot per token


@pytest.mark.parametrize("flags,match", [
    (["--router", "nope"], "'nope' is not a built-in scheme"),
    (["--router", "topk:j=2"], "unexpected keyword argument 'j'"),
    (["--grad-accum", "0"], "--grad-accum must be an integer >= 1, got 0"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be in (0, 1)"),
    (["--data", "/nonexistent/x.txt"], "--data '/nonexistent/x.txt' does not exist"),
    (["--tokenizer", "/nonexistent"], "--tokenizer '/nonexistent': not 'bytes'"),
    (["--model", "llama", "--remat", "moe"], "model llama has no such block to recompute; it supports --remat none / layer"),
    (["--dtype", "fp16"], "invalid choice: 'fp16'"),
])
def test_bad_data_and_precision_flags_are_usage_errors(flags, match, capsys):
    from fmoe.cli.train import main
    with pytest.raises(SystemExit) as e:
        main(flags)                                 # refused before anything starts
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err, err
