import pytest
import torch

from fmoe import tree


def test_paths_flatten_unflatten_roundtrip():
    t = {"layers": [{"moe": {"w_down": torch.ones(2), "router": torch.zeros(1)}}, {"moe": {"w_down": torch.ones(3), "router": torch.zeros(2)}}],
         "embed": torch.arange(3)}
    flat = tree.flatten(t)
    assert list(flat) == ["embed", "layers.0.moe.router", "layers.0.moe.w_down",
                          "layers.1.moe.router", "layers.1.moe.w_down"]
    back = tree.unflatten(flat)
    assert isinstance(back["layers"], list) and len(back["layers"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(back), tree.leaves(t)))
    assert tree.paths(tree.unflatten(flat, like=t)) == list(flat)


def test_unflatten_like_rejects_mismatch():
    with pytest.raises(ValueError, match="missing"):
        tree.unflatten({"a": 1}, like={"a": 1, "b": 2})


def test_map_with_path():
    t = {"a": {"b": 1, "c": [2, 3]}}
    out = tree.map_with_path(lambda p, x, y: (p, x + y), t, t)
    assert out == {"a": {"b": ("a.b", 2), "c": [("a.c.0", 4), ("a.c.1", 6)]}}


@pytest.mark.parametrize("pattern,path,want", [
    ("layers.*.moe.w_*", "layers.3.moe.w_down", True),
    ("layers.*.moe.w_*", "layers.3.moe.router", False),
    ("layers.*.moe.w_*", "layers.3.x.moe.w_down", False),   # fnmatch would say True
    ("layers.*", "layers.3.moe.w_down", False),
    ("*", "embed", True),
    ("*", "layers.0", False),
    ("**", "layers.0.moe.w_down", True),
    ("**.w_down", "layers.0.moe.w_down", True),
    ("**.w_down", "w_down", True),
    ("layers.**.w_down", "layers.w_down", True),
    ("layers.[0-1].attn.w?", "layers.1.attn.wq", True),
    ("layers.[0-1].attn.w?", "layers.2.attn.wq", False),
    ("layers.*.attn", "layers.1.attn.wq", False),
])
def test_glob_match_is_per_segment(pattern, path, want):
    assert tree.glob_match(pattern, path) is want
