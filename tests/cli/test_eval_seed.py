"""The held-out set is fixed by ``--eval-seed`` alone: the same tokens whatever ``--seed`` and
whatever the mesh (for one global batch), another set for another ``--eval-seed``."""

import numpy as np
import torch

import fmoe.training
from fmoe.data import TokenStream
from fmoe.training import JobConfig
from fmoe.training.evaluate import EVAL_SEED, held_out_batch
from train_cases import read_log


def test_held_out_rows_do_not_depend_on_the_mesh_and_take_only_the_eval_seed():
    s = TokenStream(np.arange(5000, dtype=np.uint16) % 251)
    one = held_out_batch(s, 3, 8, 16, EVAL_SEED)[0]
    for n in (2, 4):
        assert torch.equal(torch.cat([held_out_batch(s, 3, 8 // n, 16, EVAL_SEED, b, n)[0] for b in range(n)]), one)
    assert not torch.equal(held_out_batch(s, 3, 8, 16, EVAL_SEED + 1)[0], one)


def test_the_job_evaluates_with_the_eval_seed_not_the_training_seed(tmp_path):
    flags = dict(model="qwen3_moe", preset="tiny", steps=1, batch=2, seq=16, warmup=1, eval_every=1, eval_batches=1,
                 quiet=True)
    for name, extra in (("a", {}), ("b", {"eval_seed": 7}), ("c", {"seed": 3}), ("d", {"seed": 3, "eval_seed": 7})):
        fmoe.training.run(JobConfig(out=str(tmp_path / name), **flags, **extra))
    ev = {n: read_log(tmp_path / n)[-1]["eval_loss"] for n in "abcd"}
    assert ev["a"] != ev["b"] and ev["c"] != ev["d"]                    # --eval-seed picks the held-out set
