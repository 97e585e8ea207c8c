"""One train step walks the whole parameter tree at most 6 times (``fmoe.training.step``).

The step flattens the parameters once, hands the flat ``{path: leaf}`` dicts to the gradient
reduction (:func:`fmoe.training.grads.reduce_flat`) and the optimizer
(:func:`fmoe.optim.adamw.step_flat`), and rebuilds the nested trees once at the end: parameters
flattened and rebuilt (2), AdamW's two moment trees flattened (2) and, unless the step donates
them, rebuilt (2). Before, nested -> flat -> nested happened three times (15 walks).
"""

import collections

import pytest
import torch

from fmoe import tree as _tree
from fmoe.mesh import Mesh
from fmoe.models import qwen3_moe
from fmoe.optim.adamw import init
from fmoe.training.step import StepConfig, train_step

WALKS = ("flatten", "unflatten", "paths", "leaves", "map_with_path")


def count_walks(monkeypatch, size: int) -> collections.Counter:
    """Patch ``fmoe.tree``'s walking functions: count the calls on a tree (or flat dict) of at
    least ``size`` leaves, by function name."""
    counts: collections.Counter = collections.Counter()
    depth = [0]                                    # a walk inside a walk (unflatten's paths) is not counted
    for name in WALKS:
        fn = getattr(_tree, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            tree = args[1] if _name == "map_with_path" else args[0]
            n = len(tree) if _name == "unflatten" else len(_tree.optree.tree_leaves(tree, none_is_leaf=True))
            if n >= size and not depth[0]:
                counts[_name] += 1
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(_tree, name, counted)
    return counts


@pytest.mark.parametrize("donate,most", [(False, 6), (True, 4)])
def test_one_train_step_walks_the_parameter_tree_at_most_six_times(monkeypatch, donate, most):
    cfg = qwen3_moe.Config.tiny()
    params = _tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")),
                                 qwen3_moe.init(cfg, seed=0))
    opt = init(params)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    counts = count_walks(monkeypatch, len(_tree.leaves(params)))
    train_step(qwen3_moe, cfg, params, opt, (tokens, tokens), mesh=Mesh(), step_cfg=StepConfig(donate=donate),
               lr=1e-3)
    assert sum(counts.values()) <= most, dict(counts)
    assert counts["flatten"] >= 1                          # the counter sees the step's walks


def test_the_counter_sees_a_walk(monkeypatch):
    counts = count_walks(monkeypatch, 2)
    _tree.unflatten(_tree.flatten({"a": {"b": torch.ones(1), "c": torch.ones(1)}}))
    assert counts == {"flatten": 1, "unflatten": 1}
