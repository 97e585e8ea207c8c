import types

import pytest
import torch

import fmoe
from fmoe import P, Plan


def params():
    return {"embed": torch.zeros(16, 8),
            "layers": [{"attn": {"wq": torch.zeros(8, 8), "wo": torch.zeros(8, 8)},
                        "moe": {"router": torch.zeros(4, 8), "w_gate_up": torch.zeros(4, 6, 8),
                                "w_down": torch.zeros(4, 8, 3)}}]}


def fake_mesh(**sizes):
    full = {**dict(tp=1, fsdp=1, ep=1, efsdp=1, dp_replicate=1), **sizes}
    return types.SimpleNamespace(size=lambda a: full[a])


def test_p_is_a_leaf_and_validates():
    p = P("tp", None)
    assert not isinstance(p, tuple) and p == P("tp", None) and p != P(None, "tp")
    assert fmoe.tree.leaves({"a": p}) == [p]
    with pytest.raises(ValueError, match="unknown mesh axis 'tq'"):
        P("tq", None).validate()
    with pytest.raises(ValueError, match="only one tensor dim"):
        P("tp", "tp").validate()
    with pytest.raises(TypeError):
        P(3)


def test_resolve_first_match_wins_and_styles():
    plan = Plan({"layers.*.attn.wq": "colwise", "layers.*.attn.w*": "rowwise",
                 "layers.*.moe.w_*": P("ep", None, None), "**": P()})
    r = fmoe.tree.flatten(plan.resolve(params()))
    assert r["layers.0.attn.wq"] == P("tp", None)
    assert r["layers.0.attn.wo"] == P(None, "tp")
    assert r["layers.0.moe.w_down"] == P("ep", None, None)
    assert r["layers.0.moe.router"] == P() and r["embed"] == P()


def test_rule_matching_nothing_names_closest_paths():
    with pytest.raises(ValueError, match=r"'layers\.\*\.moe\.w_up' matches no parameter.*closest"):
        Plan({"layers.*.moe.w_up": P("ep")}, default=P()).resolve(params())


def test_default_plan_rules_only_warn():
    with pytest.warns(UserWarning, match="matches no parameter"):
        Plan({"nothing.here": P()}, default=P(), strict=False).resolve(params())


def test_uncovered_leaf_without_default():
    with pytest.raises(ValueError, match="covered by no rule.*'embed'"):
        Plan({"layers.**": P()}).resolve(params())


def test_unknown_style_and_axis():
    with pytest.raises(ValueError, match="unknown sharding style 'colwize'.*colwise"):
        Plan({"embed": "colwize"})
    with pytest.raises(ValueError, match="unknown mesh axis 'expert'"):
        Plan({"embed": P("expert")})


def test_too_many_entries():
    with pytest.raises(ValueError, match="'embed'.*3 entries but the tensor has 2 dims"):
        Plan({"embed": P("tp", None, None)}, default=P()).resolve(params())


def test_non_divisible_dim_names_path_dim_size_axis():
    with pytest.raises(ValueError, match=r"'layers\.0\.moe\.w_down'.*dim 0 of size 4 .*ep=8"):
        Plan({"layers.*.moe.w_*": P("ep")}, default=P()).resolve(params(), fake_mesh(ep=8))
    with pytest.raises(ValueError, match=r"w_gate_up.*dim 1 of size 6.*tp=2 x packed=2"):
        Plan({"**.w_gate_up": P(None, "tp", packed=2)}, default=P()).resolve(params(), fake_mesh(tp=2))


def test_override_merges_by_key_and_user_keys_are_strict():
    base = Plan({"layers.*.attn.wq": "colwise", "layers.*.attn.wo": "rowwise"}, default=P(), strict=False)
    plan = base.override({"layers.*.attn.wo": "replicate", "layers.0.attn.wq": "colwise_gather"})
    assert plan.rules == [("layers.0.attn.wq", "colwise_gather"), ("layers.*.attn.wq", "colwise"),
                          ("layers.*.attn.wo", "replicate")]
    r = fmoe.tree.flatten(plan.resolve(params()))
    assert r["layers.0.attn.wq"] == P("tp", None, gather=True) and r["layers.0.attn.wo"] == P()
    with pytest.raises(ValueError, match="'layers.*.attn.wk' matches no parameter"):
        base.override({"layers.*.attn.wk": "colwise"}).resolve(params())


def test_explain_lists_every_leaf():
    text = Plan({"layers.*.moe.w_*": "expert"}, default=P()).explain(params(), fake_mesh(ep=2))
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "rule", "placement", "local", "shape"]
    assert len(lines) == 1 + len(fmoe.tree.paths(params()))
    row = next(l for l in lines if l.startswith("layers.0.moe.w_down"))
    assert "layers.*.moe.w_*" in row and "P('ep', None, None)" in row and "(2, 8, 3)" in row
