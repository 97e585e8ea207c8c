"""The package's structure, read from its source (AST): the rules of ``ARCHITECTURE.md``.

- no import cycle between modules of ``fmoe`` (and ``models``, installed as ``fmoe.models``),
  counting imports inside functions, and counting an import of ``a.b.c`` from outside package
  ``a.b`` as importing ``a.b`` too (its ``__init__`` runs first);
- ``torch.distributed`` collectives are called only in ``fmoe/collectives.py``;
- every ``torch.autograd.Function`` is new style (``forward`` without ``ctx``, plus
  ``setup_context``);
- ``fmoe/routing`` (pure functions of the logits) and ``models/`` (math only) never import
  ``torch.distributed``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: torch.distributed functions that move data between ranks (process-group bookkeeping such as
#: get_rank / get_world_size / new_group / init_process_group is allowed anywhere).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "broadcast_object_list", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
    "barrier", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced", "batch_isend_irecv",
    "gather_object", "scatter_object_list", "_reduce_scatter_base", "_all_gather_base",
}


def _module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for fmoe/ and models/ (as fmoe.models)."""
    out = {}
    for top, prefix in (("fmoe", "fmoe"), ("models", "fmoe.models")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _module_files()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """Modules of the package that ``name`` imports (anywhere in the file)."""
    found: set[str] = set()
    base = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(TREES[name]):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from pkg import sub" needs the module pkg.sub; "from pkg import name" needs pkg itself
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        for t in targets:
            while t and t not in MODULES:          # "fmoe.nn.linear.linear" -> "fmoe.nn.linear"
                t = t.rpartition(".")[0]
            if not t or t == name:
                continue
            found.add(t)
            parent = t.rpartition(".")[0]          # the parent package runs first
            while parent and not (name == parent or name.startswith(parent + ".")):
                found.add(parent)
                parent = parent.rpartition(".")[0]
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return []


def _dist_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the ``torch.distributed`` module, and names imported from it."""
    modules, funcs = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    modules.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed" and not node.level:
            for a in node.names:
                funcs[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and not node.level:
            for a in node.names:
                if a.name == "distributed":
                    modules.add(a.asname or "distributed")
    return modules, funcs


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def collective_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every torch.distributed collective called (or looked up) in ``tree``."""
    modules, funcs = _dist_aliases(tree)
    modules |= {"torch.distributed"}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _dotted(node.value) in modules:
            hits.append((node.lineno, f"{_dotted(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Name) and funcs.get(node.id) in COLLECTIVES:
            hits.append((node.lineno, node.id))
    return hits


def _is_autograd_function(cls: ast.ClassDef) -> bool:
    return any(_dotted(b).endswith("autograd.Function") or _dotted(b) == "Function" for b in cls.bases)


def old_style_functions(tree: ast.AST) -> list[str]:
    """Autograd Functions whose ``forward`` takes ``ctx`` or that lack ``setup_context``."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _is_autograd_function(node):
            methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            fwd = methods.get("forward")
            first = fwd.args.args[0].arg if fwd is not None and fwd.args.args else None
            if first == "ctx" or "setup_context" not in methods:
                bad.append(f"{node.name} (line {node.lineno})")
    return bad


def imports_torch_distributed(tree: ast.AST) -> list[int]:
    """Lines that import ``torch.distributed`` (or anything under it)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("torch.distributed"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            lines.append(node.lineno)
    return lines


# ------------------------------------------------------------------------------- the rules
def test_no_import_cycles():
    graph = {name: _imports(name) for name in MODULES}
    assert find_cycle(graph) == []


def test_collectives_only_in_fmoe_collectives():
    found = {name: collective_calls(tree) for name, tree in TREES.items() if name != "fmoe.collectives"}
    assert {k: v for k, v in found.items() if v} == {}
    assert collective_calls(TREES["fmoe.collectives"])       # the rule can see a collective


def test_every_autograd_function_is_new_style():
    found = {name: old_style_functions(tree) for name, tree in TREES.items()}
    assert {k: v for k, v in found.items() if v} == {}
    assert any("class _" in MODULES[n].read_text() and "autograd.Function" in MODULES[n].read_text()
               for n in MODULES)                              # there are Functions to check


@pytest.mark.parametrize("prefix", ["fmoe.routing", "fmoe.models"])
def test_routing_and_models_do_not_import_torch_distributed(prefix):
    checked = [n for n in MODULES if n == prefix or n.startswith(prefix + ".")]
    assert checked
    found = {n: imports_torch_distributed(TREES[n]) for n in checked}
    assert {k: v for k, v in found.items() if v} == {}


# ------------------------------------------------------------------------------- the rules can fail
def test_the_checks_catch_what_they_look_for():
    """Each rule flags a small bad example (so a passing rule means something)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    calls = ast.parse("import torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
                      "def f(x):\n    dist.all_to_all_single(x, x)\n    ar(x)\n    torch.distributed.barrier()\n"
                      "    dist.get_rank()\n")
    assert [n for _, n in collective_calls(calls)] == ["dist.all_to_all_single", "ar", "torch.distributed.barrier"] \
        or sorted(n for _, n in collective_calls(calls)) == sorted(["dist.all_to_all_single", "ar",
                                                                   "torch.distributed.barrier"])
    old = ast.parse("import torch\nclass F(torch.autograd.Function):\n    @staticmethod\n"
                    "    def forward(ctx, x):\n        return x\n    @staticmethod\n"
                    "    def backward(ctx, g):\n        return g\n")
    new = ast.parse("import torch\nclass F(torch.autograd.Function):\n    @staticmethod\n"
                    "    def forward(x):\n        return x\n    @staticmethod\n"
                    "    def setup_context(ctx, inputs, output):\n        pass\n")
    assert old_style_functions(old) == ["F (line 2)"] and old_style_functions(new) == []
    assert imports_torch_distributed(ast.parse("from torch.distributed.tensor import DTensor")) == [1]
    assert imports_torch_distributed(ast.parse("import torch.nn")) == []


def test_a_submodule_import_counts_its_package():
    """``fmoe.x`` importing ``fmoe.routing.core`` runs ``fmoe/routing/__init__`` first: an edge."""
    assert "fmoe.routing" in _imports("fmoe.moe")
    assert "fmoe.routing" not in _imports("fmoe.routing.topk")     # inside the package: no edge


# ------------------------------------------------------------------------------- the model interface
MODEL_FILES = sorted(n for n in MODULES if n.startswith("fmoe.models.") and not n.rpartition(".")[2].startswith("_"))
GENERIC = [n for n in MODULES if n.startswith(("fmoe.models", "fmoe.train", "fmoe.checkpoint", "fmoe.generate"))
           or n in ("fmoe.model", "fmoe.memory_plan", "fmoe.plan.__main__")]


def probes(tree: ast.AST) -> list[str]:
    """``sys.modules``, ``inspect.signature`` and any ``hasattr`` (on a model, its config or a
    tensor: what a model offers is declared on its ``Model``; reading an optional, documented
    field with ``getattr(obj, name, default)`` is not probing)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _dotted(node) in ("sys.modules", "inspect.signature"):
            found.append(f"{_dotted(node)} (line {node.lineno})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
            what = _dotted(node.args[0]) if node.args else ""
            found.append(f"hasattr({what}, ...) (line {node.lineno})")
    return found


def test_models_are_used_through_their_declared_interface_not_probed():
    found = {n: probes(TREES[n]) for n in GENERIC}
    assert {k: v for k, v in found.items() if v} == {}
    assert sorted(probes(ast.parse("import sys\nm = sys.modules[__name__]\nhasattr(model, 'check_plan')\n"
                                   "hasattr(cfg, 'output_router_logits')"))) == [
        "hasattr(cfg, ...) (line 4)", "hasattr(model, ...) (line 3)", "sys.modules (line 2)"]


@pytest.mark.parametrize("name", MODEL_FILES)
def test_every_model_module_declares_one_model(name):
    import importlib

    from fmoe.model import Model, model_of

    module = importlib.import_module(name)
    declared = model_of(module)
    assert isinstance(declared, Model) and declared.name == name.rpartition(".")[2]
    for attr in ("Config", "init", "forward", "plan", "hf_specs"):
        assert getattr(declared, attr) is getattr(module, attr), attr
    for wrapper in ("check_plan", "shard", "load_hf", "save_hf"):   # written once, in fmoe.model
        assert getattr(module, wrapper) == getattr(declared, wrapper), wrapper


# ------------------------------------------------------------------------------- no hidden state
def module_state(tree: ast.AST) -> list[str]:
    """``global`` statements anywhere, and module-level names bound to a mutable container
    (dict / list / set displays or calls, ``weakref`` / ``collections`` objects) that the module
    itself mutates (subscript assignment, or a call of a mutating method on the name)."""
    found = [f"global (line {n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    containers = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
            isinstance(value, ast.Call) and _dotted(value.func).split(".")[-1] in
            ("dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary", "WeakKeyDictionary"))
        for t in targets:
            if mutable and isinstance(t, ast.Name):
                containers[t.id] = node.lineno
    mutators = {"append", "extend", "update", "pop", "popitem", "setdefault", "clear", "add", "remove", "discard",
                "insert", "__setitem__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in containers:
                    found.append(f"{t.value.id} (line {containers[t.value.id]}) changed at line {node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators
              and isinstance(node.func.value, ast.Name) and node.func.value.id in containers):
            found.append(f"{node.func.value.id} (line {containers[node.func.value.id]}) changed at line {node.lineno}")
    return found


def test_no_module_level_mutable_state():
    """The one registry by design: ``fmoe.ep`` (``ep.register`` fills it)."""
    found = {n: module_state(t) for n, t in TREES.items() if n != "fmoe.ep"}
    assert {k: v for k, v in found.items() if v} == {}
    assert module_state(TREES["fmoe.ep"])                               # the rule sees the registry
    bad = ast.parse("_ACTIVE: dict = {}\ndef f(k, v):\n    _ACTIVE[k] = v\n_STATS = {'n': 0}\n"
                    "def g():\n    global X\n    _STATS.update(n=1)\n")
    assert module_state(bad) == ["global (line 6)", "_ACTIVE (line 1) changed at line 3",
                                 "_STATS (line 4) changed at line 7"]


# ------------------------------------------------------------------------------- layers (ARCHITECTURE.md)
LAYERS = [   # (layer, module prefixes), bottom up; a module may import its own layer or lower ones
    (0, ("fmoe.tree", "fmoe.mesh", "fmoe.collectives", "fmoe.launch", "fmoe.transforms", "fmoe.activations")),
    (1, ("fmoe.placement", "fmoe.plan", "fmoe.sharding")),
    (2, ("fmoe.experts", "fmoe.expert_blocks", "fmoe.grouped_mm", "fmoe.fsdp", "fmoe.global_stats", "fmoe.load_stats", "fmoe.remat")),
    (3, ("fmoe.routing", "fmoe.ep", "fmoe.aux_losses")),
    (4, ("fmoe.moe", "fmoe.nn", "fmoe.shared_experts")),
    (5, ("fmoe.model", "fmoe.testing", "fmoe.train", "fmoe.checkpoint", "fmoe.generate", "fmoe.data", "fmoe.memory_plan", "fmoe.plan.__main__",
         "fmoe.plot")),
    (6, ("fmoe.models",)),
]


def layer_of(name: str) -> int:
    if name == "fmoe":                 # the public namespace: re-exports layers 0-5
        return 5
    best = None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (layer, len(p))
    assert best is not None, f"{name} is in no layer of ARCHITECTURE.md"
    return best[0]


def test_imports_point_down_the_layers():
    up = sorted(f"{n} (layer {layer_of(n)}) imports {m} (layer {layer_of(m)})"
                for n in MODULES for m in _imports(n) if n != "fmoe" and layer_of(m) > layer_of(n))
    assert up == []
    assert layer_of("fmoe.models.qwen3_moe") == 6 and layer_of("fmoe.expert_blocks") == 2


# ------------------------------------------------------------------------------- explicit data, not identity
BUILTIN_IMPLS = {"all_to_all_impl", "all_reduce_impl", "local", "ALL_TO_ALL", "ALL_REDUCE", "LOCAL",
                 "folds_stats", "_token_dispatch", "_exchange_splits"}


def identity_dispatch(tree: ast.AST) -> list[str]:
    """``x is <name>`` / ``x is not <name>`` comparisons against a function or implementation
    object (a path chosen by object identity), and references to a built-in expert-parallel
    implementation by attribute (``ep.all_to_all_impl``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                name = _dotted(right)
                if isinstance(op, (ast.Is, ast.IsNot)) and name and name.split(".")[-1] not in ("None", "True", "False"):
                    found.append(f"line {node.lineno}: is {name}")
        if isinstance(node, ast.Attribute) and node.attr in BUILTIN_IMPLS:
            found.append(f"line {node.lineno}: {_dotted(node)}")
    return found


def test_the_layer_treats_every_implementation_alike_and_paths_are_chosen_by_data():
    """``fmoe.moe`` runs every expert-parallel implementation through ``ep.run`` (no built-in
    named, no identity test), and no module picks a compute path by ``act is swiglu``."""
    assert identity_dispatch(TREES["fmoe.moe"]) == []
    assert {n: f for n, t in TREES.items() if n.startswith(("fmoe.experts", "fmoe.ep", "fmoe.nn", "fmoe.shared_experts"))
            for f in [[x for x in identity_dispatch(t) if " is " in x]] if f} == {}
    bad = ast.parse("def f(act, ep):\n    if act is swiglu:\n        pass\n    return ep.all_to_all_impl\n")
    assert identity_dispatch(bad) == ["line 2: is swiglu", "line 4: ep.all_to_all_impl"]
