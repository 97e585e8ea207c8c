"""The router contract end to end: every aux entry is trained (a ``Loss``) or logged (a tensor or
``GlobalStat``), whatever its name, and reaches ``log.jsonl``; anything else is an error naming it."""

import pytest
import torch

import fmoe.training
from fmoe.routing.global_stats import GlobalStat
from fmoe.routing import Loss, Routing, topk
from fmoe.training import JobConfig, StepConfig
from fmoe.routing.aux_losses import with_losses
from train_cases import read_log

FLAGS = dict(model="qwen3_moe", preset="tiny", steps=2, batch=2, seq=16, warmup=1, quiet=True)


def penalized(weight, extra=None):
    """Top-2 plus a penalty named without ``_loss`` and a statistic of the global batch."""
    base = topk(2)

    def router(logits):
        r = base(logits)
        probs = torch.softmax(logits.float(), -1)                          # [T, E]
        aux = {"zz_penalty": Loss(weight * probs.square().sum(-1).mean()),
               "top_share": GlobalStat({"top": r.weights[:, 0].detach().sum(), "n": probs.new_tensor(float(len(probs)))},
                                       lambda s: s["top"] / s["n"]),
               **(extra or {})}
        return Routing(r.weights, r.expert_ids, aux)

    return router


def run(out, router):
    fmoe.training.run(JobConfig(out=str(out), **FLAGS), step_config=StepConfig(router=router))
    return read_log(out)


def test_a_loss_named_anything_trains_and_a_statistic_is_logged(tmp_path):
    off, on = run(tmp_path / "off", penalized(0.0)), run(tmp_path / "on", penalized(1.0))
    assert off[0]["loss"] == on[0]["loss"]                                 # the same forward ...
    assert off[0]["grad_norm"] != on[0]["grad_norm"]                       # ... other gradients
    assert off[1]["loss"] != on[1]["loss"]
    assert on[0]["zz_penalty"] > 0.1 and off[0]["zz_penalty"] == 0.0       # summed over the 2 MoE layers
    for row in on:
        assert len(row["top_share"]) == 2 and all(0.5 <= v <= 1.0 for v in row["top_share"]), row["top_share"]
    # the built-in losses are Loss entries too: logged under their keys
    lb = run(tmp_path / "lb", with_losses(penalized(0.0), load_balance=0.01))
    assert lb[0]["load_balance_loss"] > 0 and "top_share" in lb[0]


def test_an_entry_that_is_neither_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match=r"aux\['note'\] is str"):
        run(tmp_path / "bad", penalized(1.0, {"note": "hello"}))


def test_hash_router_trains_through_the_job_on_every_mesh(tmp_path):
    """``--router hash_router`` (it declares ``token_ids``, which every model offers): one data
    batch on tp2/ep2 and tp2/ep2 --sp (a rank routes its piece of the sequence, so its token ids
    must be that piece's) equals one process, loss and expert load; ep2 (two batches) routes every
    token of both."""
    from helpers import close

    flags = dict(FLAGS, router="hash_router:k=2")
    rows = {}
    for name, mesh in {"one": dict(nproc=1), "tp2/ep2": dict(nproc=2, tp=2, ep=2),
                       "tp2/ep2 sp": dict(nproc=2, tp=2, ep=2, sp=True), "ep2": dict(nproc=2, ep=2)}.items():
        out = tmp_path / name.replace("/", "").replace(" ", "")
        fmoe.training.run(JobConfig(out=str(out), **flags, **mesh))
        rows[name] = read_log(out)[-1]
    one = rows.pop("one")
    for name in ("tp2/ep2", "tp2/ep2 sp"):
        close(torch.tensor(rows[name]["loss"]), torch.tensor(one["loss"]), name)
        assert rows[name]["expert_load"] == one["expert_load"], name
    assert [sum(layer) for layer in rows["ep2"]["expert_load"]] == [2 * 2 * 2 * 16] * 2    # k * batches * B * S


def test_router_state_moves_every_step_and_resumes_bitwise(tmp_path):
    """ReMoE (``--router remoe``): its L1 coefficient is router state, moved after every step from
    the global ``active`` statistic, logged per layer, checkpointed with the parameters; a run
    resumed from step 2 equals the uninterrupted run bitwise, state included."""
    import json

    flags = dict(FLAGS, router="remoe:k=2,l1_init=0.01", steps=4)
    fmoe.training.run(JobConfig(out=str(tmp_path / "a"), save_every=2, **flags))
    fmoe.training.run(JobConfig(out=str(tmp_path / "b"), resume=str(tmp_path / "a" / "step-2"), **flags))
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    coefs = [r["l1_coef"][0] for r in a]
    assert all(r["active"][0] > 2 for r in a[:2]) and coefs[:2] == pytest.approx([0.012, 0.0144])   # x1.2 while dense
    keys = ("loss", "grad_norm", "l1_coef", "l1_loss", "active", "expert_load")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a[2:]]
    saved = json.load(open(tmp_path / "a" / "step-2" / "meta.json"))
    assert saved["settings"]["router"] == flags["router"]


def test_the_router_changes_on_resume_only_behind_router_changed(tmp_path, capfd):
    """``--resume R --router X`` is refused (the router is kept); with ``--router-changed`` the run
    continues with X on the checkpoint's parameters and optimizer state, the new router recorded
    and the change said on stderr. A stateful router (ReMoE) resumed from a top-k checkpoint starts
    its state from its own ``init``, said on stderr too."""
    import json

    from fmoe.training import JobConfigError

    flags = dict(FLAGS, balance="z")
    fmoe.training.run(JobConfig(out=str(tmp_path / "a"), router="topk:k=2", **flags))
    resume = dict(flags, steps=3, router="topk:k=1", resume=str(tmp_path / "a" / "step-2"))
    with pytest.raises(JobConfigError, match=r"trained with --router 'topk:k=2'.*Changeable on resume: .*--router-changed"):
        fmoe.training.run(JobConfig(out=str(tmp_path / "b"), **resume))
    fmoe.training.run(JobConfig(out=str(tmp_path / "c"), router_changed=True, **resume))
    row = read_log(tmp_path / "c")[-1]
    assert row["step"] == 3 and [sum(layer) for layer in row["expert_load"]] == [2 * 16] * 2     # top-1 now
    meta = json.load(open(tmp_path / "c" / "step-3" / "meta.json"))
    assert meta["settings"]["router"] == "topk:k=1"
    where = tmp_path / "a" / "step-2"
    assert (f"note: --router-changed: --resume {where} trained with --router topk:k=2; continuing with --router "
            "topk:k=1\n") in capfd.readouterr().err
    remoe = "remoe:k=2,l1_init=0.01"
    fmoe.training.run(JobConfig(out=str(tmp_path / "d"), router_changed=True, **dict(resume, router=remoe)))
    err = capfd.readouterr().err
    assert f"trained with --router topk:k=2; continuing with --router {remoe}" in err, err
    assert f"--resume {where} holds no router state l1_coef: 2 leaves start from --router {remoe}'s init" in err, err
    row = read_log(tmp_path / "d")[-1]
    assert row["step"] == 3 and row["l1_coef"] == pytest.approx([0.012 if a > 2 else 0.01 / 1.2 for a in row["active"]])
