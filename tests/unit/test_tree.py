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


# --------------------------------------------------------- the plain walk while Dynamo traces
def _mixed_tree():
    t = [torch.full((2,), float(i)) for i in range(5)]
    return {"b": t[0], "a": {"d": t[1], "c": None}, "e": (t[2], [t[3], {"y": t[4], "x": 7}]), "z": []}


def _everything(t):
    """Every tree function on ``t``, with the order in which ``map_with_path`` calls its function."""
    calls = []
    mapped = tree.map_with_path(lambda p, x, y: calls.append(p) or (x, y), t, t)
    flat = tree.flatten(t)
    return (flat, tree.paths(t), tree.leaves(t), tree.unflatten(flat, like=t), mapped, calls)


def _same(got, want):
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want)        # same keys, same order
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    else:
        assert got == want


class _NoOptree:
    def __getattr__(self, name):
        raise AssertionError(f"optree.{name} called while Dynamo traces a plain tree")


def test_traced_tree_functions_walk_plain_trees_without_optree_and_agree_with_it(monkeypatch):
    """Under ``torch.compile`` (fullgraph) a dict / list / tuple / None tree is walked without optree
    (Dynamo would replay optree's C++ through its Python polyfills, ~10x the traced calls), with
    optree's results: paths in sorted-key order, dicts rebuilt in their own key order, the mapped
    function called in path order, tuples kept tuples, ``None`` a node without leaves."""
    t = _mixed_tree()
    want = _everything(t)
    assert want[1] == ["a.d", "b", "e.0", "e.1.0", "e.1.1.x", "e.1.1.y"]
    monkeypatch.setattr(tree, "optree", _NoOptree())
    torch._dynamo.reset()
    got = torch.compile(_everything, fullgraph=True, backend="eager")(t)
    _same(got, want)
    with pytest.raises(AssertionError, match="optree.tree_flatten_with_path"):
        tree.flatten(t)                                                   # eager: optree, as before


def test_traced_tree_functions_walk_namedtuples_and_ordered_dicts_as_optree_does(monkeypatch):
    """namedtuple (by index) and ``OrderedDict`` (insertion order) nodes walked while tracing, with
    optree's paths (Dynamo's own optree polyfill writes ``['p']..w`` for a namedtuple field)."""
    import collections
    Pair = collections.namedtuple("Pair", "w b")
    t = {"p": Pair(torch.ones(2), torch.zeros(1)), "o": collections.OrderedDict(z=torch.ones(1), a=torch.ones(3))}
    want = _everything(t)
    assert want[5] == ["o.z", "o.a", "p.0", "p.1"]
    monkeypatch.setattr(tree, "optree", _NoOptree())
    torch._dynamo.reset()
    _same(torch.compile(_everything, fullgraph=True, backend="eager")(t), want)


def test_traced_tree_functions_leave_other_node_types_to_optree():
    """A ``defaultdict`` or ``deque`` node: the traced call takes optree (its Dynamo polyfill), the
    same leaves as eager, and ``map_with_path`` calls its function once per leaf."""
    import collections
    t = {"d": collections.deque([torch.ones(2), torch.zeros(1)]), "w": torch.ones(3)}
    want = _everything(t)
    torch._dynamo.reset()
    got = torch.compile(_everything, backend="eager")(t)
    assert len(got[5]) == len(want[5]) == 3
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def test_traced_map_with_path_refuses_trees_that_differ():
    with pytest.raises(Exception, match="differ"):
        torch._dynamo.reset()
        torch.compile(lambda a, b: tree.map_with_path(lambda p, x, y: x + y, a, b), fullgraph=True,
                      backend="eager")({"a": torch.ones(1)}, {"b": torch.ones(1)})
