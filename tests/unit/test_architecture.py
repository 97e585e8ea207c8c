"""The package's structure, read from its source (AST): the rules of ``ARCHITECTURE.md``.

- no import cycle between modules of ``fmoe`` (and ``models``, installed as ``fmoe.models``),
  counting imports inside functions, and counting an import of ``a.b.c`` from outside package
  ``a.b`` as importing ``a.b`` too (its ``__init__`` runs first);
- ``torch.distributed`` collectives are called only in ``fmoe/collectives/``;
- every ``torch.autograd.Function`` is new style (``forward`` without ``ctx``, plus
  ``setup_context``);
- ``fmoe/routing`` (pure functions of the logits) and ``models/`` (math only) never import
  ``torch.distributed``;
- imports point down the layers of ``ARCHITECTURE.md``, the programs (layer 8, ``fmoe/cli/``) above
  the training job (7) and the models (6): program code lives only in ``fmoe/cli/`` (nothing else
  imports ``argparse`` or ``fmoe.cli``), no library package has a ``__main__`` (``fmoe/__main__.py``
  hands over to ``fmoe.cli``), ``fmoe/train/`` is gone and the README is a front page;
- no compatibility aliases (alias modules, second names, parameter aliases);
- one model registry (``fmoe.models``): no ``import_module`` of a model and no table of model
  names elsewhere, no guessed config fields;
- ``fmoe.moe`` chooses an expert-parallel implementation by the registry's declared properties,
  naming no built-in.

Each rule also runs on a small bad example (so a passing rule means something).
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
    home = [n for n in TREES if n == "fmoe.collectives" or n.startswith("fmoe.collectives.")]
    found = {name: collective_calls(tree) for name, tree in TREES.items() if name not in home}
    assert {k: v for k, v in found.items() if v} == {}
    assert any(collective_calls(TREES[n]) for n in home)      # the rule can see a collective


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
GENERIC = [n for n in MODULES if n.startswith(("fmoe.models", "fmoe.cli", "fmoe.checkpoint", "fmoe.model."))
           or n in ("fmoe.model", "fmoe.memory.plan") or n.startswith("fmoe.training")]


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


def private_uses(tree: ast.AST) -> list[str]:
    """What a model file uses that is not public: an import of a module or a name with a
    ``_``-prefixed segment (``from . import _common``, ``fmoe.nn._tp``), or an ``fmoe.`` attribute
    chain through one (dunders aside): a model outside the repo can copy a shipped one."""
    private = lambda dotted: any(s.startswith("_") and not s.endswith("__") for s in dotted.split("."))  # noqa: E731
    found, inner = [], {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names = ["." * node.level + (f"{node.module}." if node.module else "") + a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner and _dotted(node).startswith("fmoe."):
            names = [_dotted(node)]
        found += [f"{n} (line {node.lineno})" for n in names if private(n.lstrip("."))]
    return sorted(set(found))


def test_models_import_nothing_private():
    """The shipped models are written on the public kit (``fmoe.model``), as a user's would be."""
    found = {n: private_uses(TREES[n]) for n in MODULES if n == "fmoe.models" or n.startswith("fmoe.models.")}
    assert {k: v for k, v in found.items() if v} == {}
    old = ast.parse("from __future__ import annotations\nfrom . import _common, _hf\nfrom fmoe.nn._tp import g\n"
                    "import fmoe\nx = fmoe.nn._tp.group(w)\ny = fmoe.model.__name__\n")
    assert private_uses(old) == ["._common (line 2)", "._hf (line 2)", "fmoe.nn._tp.g (line 3)",
                                 "fmoe.nn._tp.group (line 5)"]


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
    """The registries by design: ``fmoe.ep`` (``ep.register`` fills it) and ``fmoe.models``
    (``models.register``, and the entry points read once per ``sys.path``)."""
    found = {n: module_state(t) for n, t in TREES.items() if n not in ("fmoe.ep", "fmoe.models")}
    assert {k: v for k, v in found.items() if v} == {}
    assert module_state(TREES["fmoe.ep"])                               # the rule sees the registry
    bad = ast.parse("_ACTIVE: dict = {}\ndef f(k, v):\n    _ACTIVE[k] = v\n_STATS = {'n': 0}\n"
                    "def g():\n    global X\n    _STATS.update(n=1)\n")
    assert module_state(bad) == ["global (line 6)", "_ACTIVE (line 1) changed at line 3",
                                 "_STATS (line 4) changed at line 7"]


# ------------------------------------------------------------------------------- layers (ARCHITECTURE.md)
#: The programs, ``fmoe <command>``: they parse, lock, launch and report, above everything else.
PROGRAMS = ("fmoe.cli", "fmoe.__main__")

LAYERS = [   # (layer, module prefixes), bottom up; a module may import its own layer or lower ones
    (0, ("fmoe.tree", "fmoe.mesh", "fmoe.collectives", "fmoe.launch", "fmoe.transforms", "fmoe.precision")),
    (1, ("fmoe.sharding",)),
    (2, ("fmoe.experts", "fmoe.fsdp")),
    (3, ("fmoe.routing", "fmoe.ep")),
    (4, ("fmoe.moe", "fmoe.nn")),
    (5, ("fmoe.model", "fmoe.testing", "fmoe.optim", "fmoe.checkpoint",
         "fmoe.data", "fmoe.memory", "fmoe.memory.plan", "fmoe.memory.peak", "fmoe.memory.tracker")),
    (6, ("fmoe.models",)),
    (7, ("fmoe.training", "fmoe.memory.dry_run")),      # the job: a model by name, its step, its run
    (8, PROGRAMS),
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


IMPORTS = {name: _imports(name) for name in MODULES}


def upward_imports(modules) -> list[str]:
    """Imports of a higher layer than the importer's (the namespace ``fmoe`` aside)."""
    return sorted(f"{n} (layer {layer_of(n)}) imports {m} (layer {layer_of(m)})"
                  for n in modules for m in IMPORTS[n] if n != "fmoe" and layer_of(m) > layer_of(n))


def test_imports_point_down_the_layers():
    assert upward_imports(MODULES) == []
    assert layer_of("fmoe.models.qwen3_moe") == 6 and layer_of("fmoe.experts.blocked") == 2
    assert layer_of("fmoe.cli.train") == 8 and layer_of("fmoe.sharding.plan") == 1 and layer_of("fmoe.training.step") == 7


def memory_imports(imports) -> list[str]:
    """Imports of ``fmoe.memory`` (any module of it) by the dispatch (``fmoe.ep``) or the experts."""
    return sorted(f"{n} imports {m}" for n, ms in imports.items() if n.startswith(("fmoe.ep", "fmoe.experts"))
                  for m in ms if m == "fmoe.memory" or m.startswith("fmoe.memory."))


def test_dispatch_and_experts_never_import_memory():
    """The expert-parallel dispatch and the expert layer size their splits on fake tensors with
    their own rule (``fmoe.experts.fake_splits``): neither imports the memory plan's package, which
    sits above the models (issue 45: ep -> memory -> training ran against the layers)."""
    assert memory_imports(IMPORTS) == []
    assert "fmoe.experts.fake_splits" in IMPORTS["fmoe.ep.token_dispatch"]
    bad = {"fmoe.ep.token_dispatch": {"fmoe.memory.fake_splits", "fmoe.collectives"}, "fmoe.memory.peak": {"fmoe.memory"}}
    assert memory_imports(bad) == ["fmoe.ep.token_dispatch imports fmoe.memory.fake_splits"]


def test_the_library_and_the_models_import_no_program():
    """Programs sit above the library, the models and the job: nothing below imports one, so the
    library is usable without any command line."""
    below = [n for n in MODULES if n != "fmoe" and layer_of(n) < 8]
    assert [u for u in upward_imports(below) if "(layer 8)" in u] == []
    assert {n for n in MODULES if layer_of(n) == 8} >= {"fmoe.cli.train", "fmoe.cli.memory", "fmoe.__main__"}


# ------------------------------------------------------------------------------- programs in one room
def is_program(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROGRAMS)


def stdlib_imports(tree: ast.AST) -> set[str]:
    """Top-level names of every module a tree imports (``import argparse``, ``from argparse import ...``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.partition(".")[0])
    return found


def reads_a_command_line(names, trees) -> list[str]:
    """Modules outside the programs that import ``argparse`` (program code in the library)."""
    return sorted(n for n in names if not is_program(n) and "argparse" in stdlib_imports(trees[n]))


def main_modules(names) -> list[str]:
    """Every ``__main__`` module but the one entry point ``fmoe/__main__.py``."""
    return sorted(n for n in names if n.rpartition(".")[2] == "__main__" and n != "fmoe.__main__")


def program_importers(names, imports) -> list[str]:
    """Modules outside the programs that import one (``fmoe.cli`` or a module of it)."""
    return sorted(n for n in names if not is_program(n) and any(is_program(m) for m in imports[n]))


def test_program_code_lives_only_in_fmoe_cli():
    """argv is parsed in ``fmoe/cli/`` alone: the library never imports ``argparse``."""
    assert reads_a_command_line(MODULES, TREES) == []
    old = {"fmoe.train.flags": ast.parse("import argparse\n"), "fmoe.memory.dry_run": ast.parse("from argparse import Namespace\n"),
           "fmoe.cli.train": ast.parse("import argparse\n")}
    assert reads_a_command_line(old, old) == ["fmoe.memory.dry_run", "fmoe.train.flags"]


def test_no_library_package_has_a_main():
    """``python -m fmoe <command>`` is the one module entry point, a handover to ``fmoe.cli``."""
    assert main_modules(MODULES) == []
    assert IMPORTS["fmoe.__main__"] <= {"fmoe", "fmoe.cli"} and len(TREES["fmoe.__main__"].body) <= 4
    old = ["fmoe.train.__main__", "fmoe.generate.__main__", "fmoe.data.__main__", "fmoe.plan.__main__", "fmoe.__main__"]
    assert main_modules(old) == ["fmoe.data.__main__", "fmoe.generate.__main__", "fmoe.plan.__main__", "fmoe.train.__main__"]


def test_nothing_outside_fmoe_cli_imports_a_program():
    assert program_importers(MODULES, IMPORTS) == []
    old = {"fmoe.generate.decode": {"fmoe.cli.train"}, "fmoe.cli.generate": {"fmoe.cli.train"}, "fmoe.model": {"fmoe.tree"}}
    assert program_importers(old, old) == ["fmoe.generate.decode"]


def test_the_train_cli_package_is_gone_and_the_readme_is_a_front_page():
    """``fmoe/train/`` next to ``fmoe/training/`` was one letter of confusion; the README (787 lines
    on 2026-12-04) is a front page whose topics live in ``docs/``."""
    assert not (ROOT / "fmoe" / "train").exists()
    assert not any(n == "fmoe.train" or n.startswith("fmoe.train.") for n in MODULES)
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md: {lines} lines"


# ------------------------------------------------------------------------------- explicit data, not identity
BUILTIN_IMPLS = {"ALL_TO_ALL", "ALL_REDUCE", "LOCAL",
                 "folds_stats", "_token_dispatch", "_exchange_splits"}


def identity_dispatch(tree: ast.AST) -> list[str]:
    """``x is <name>`` / ``x is not <name>`` comparisons against a function or implementation
    object (a path chosen by object identity), and references to a built-in expert-parallel
    implementation by attribute (``ep.ALL_TO_ALL``)."""
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
    assert {n: f for n, t in TREES.items() if n.startswith(("fmoe.experts", "fmoe.ep", "fmoe.nn"))
            for f in [[x for x in identity_dispatch(t) if " is " in x]] if f} == {}
    bad = ast.parse("def f(act, ep):\n    if act is swiglu:\n        pass\n    return ep.ALL_TO_ALL\n")
    assert identity_dispatch(bad) == ["line 2: is swiglu", "line 4: ep.ALL_TO_ALL"]


# ------------------------------------------------------------------------------- no compat layer
def _docstring_or_all(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)) \
        or (isinstance(node, ast.Assign) and [_dotted(t) for t in node.targets] == ["__all__"])


def alias_module(tree: ast.AST) -> bool:
    """A module (not a package ``__init__``) made only of imports, its docstring and
    ``__all__`` aside: a second name for code that lives elsewhere."""
    body = [n for n in tree.body if not _docstring_or_all(n)]
    return bool(body) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body)


def name_aliases(tree: ast.AST) -> list[str]:
    """Module-level ``new = old`` where ``old`` is a function, class or import of the module
    (one object under two names), and a parameter that, when given, overwrites another one
    (``if impl is not None: matmul = impl``)."""
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    found = [f"{node.targets[0].id} = {node.value.id} (line {node.lineno})" for node in tree.body
             if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
             and isinstance(node.value, ast.Name) and node.value.id in bound]
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for node in ast.walk(fn):
            test = node.test if isinstance(node, ast.If) else None
            if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id in params
                    and isinstance(test.ops[0], ast.IsNot) and _dotted(test.comparators[0]) == ""):
                continue
            for st in node.body:
                if (isinstance(st, ast.Assign) and isinstance(st.value, ast.Name) and st.value.id == test.left.id
                        and any(isinstance(t, ast.Name) and t.id in params for t in st.targets)):
                    found.append(f"{fn.name}({test.left.id}=) overrides {st.targets[0].id} (line {st.lineno})")
    return found


def test_no_compatibility_aliases():
    """No alias modules, no second names, no parameter aliases: a rename updates every caller."""
    assert sorted(n for n, t in TREES.items() if not _is_package(n) and alias_module(t)) == []
    assert {n: f for n, t in TREES.items() for f in [name_aliases(t)] if f} == {}
    assert alias_module(ast.parse('"""Former home."""\nfrom .routing.aux_losses import *\n'
                                  'from .routing.aux_losses import __all__\n'))
    assert not alias_module(ast.parse("import sys\nfrom .cli import main\nsys.exit(main())\n"))
    old = ast.parse("from .x import unshard\ndef grad_sum(x):\n    return x\ncopy_to = grad_sum\nmaterialize = unshard\n"
                    "N = 3\ndef mlp(x, matmul='auto', *, impl=None):\n    if impl is not None:\n        matmul = impl\n")
    assert name_aliases(old) == ["copy_to = grad_sum (line 4)", "materialize = unshard (line 5)",
                                 "mlp(impl=) overrides matmul (line 9)"]


# ------------------------------------------------------------------------------- one model registry
MODEL_NAMES = {n.rpartition(".")[2] for n in MODEL_FILES}


def model_lookups(tree: ast.AST) -> list[str]:
    """Models found by name around the registry: ``import_module`` of an ``fmoe.models`` path,
    and tables (tuple, list, set, dict keys) that list two or more models by name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func).endswith("import_module") and node.args:
            arg = node.args[0]
            head = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
            if isinstance(head, ast.Constant) and str(head.value).startswith("fmoe.models"):
                found.append(f"import_module (line {node.lineno})")
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
        named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in MODEL_NAMES]
        if len(named) >= 2:
            found.append(f"table of {len(named)} models (line {node.lineno})")
    return found


def test_one_model_registry():
    """Every program finds a model through ``fmoe.models.get`` (models/__init__.py, the one
    place that lists them); what a model offers is declared on its ``Model``."""
    assert MODEL_NAMES >= {"qwen3_moe", "llama"}
    assert {n: f for n, t in TREES.items() if n != "fmoe.models" for f in [model_lookups(t)] if f} == {}
    assert IMPORTS["fmoe.models"] >= set(MODEL_FILES)                   # the registry holds every model
    old = ast.parse('import importlib\nMODELS = ("qwen3_moe", "mixtral", "llama")\n'
                    'REMAT = {"qwen3_moe": ("layer", "moe"), "llama": ("layer",)}\n'
                    'def load(name):\n    return importlib.import_module(f"fmoe.models.{name}")\n')
    assert sorted(model_lookups(old)) == ["import_module (line 5)", "table of 2 models (line 3)",
                                          "table of 3 models (line 2)"]


def guessed_fields(tree: ast.AST) -> list[str]:
    """``getattr(cfg, name, default)`` on a config or model: a field guessed, not declared."""
    return [f"getattr({_dotted(n.args[0])}, ...) (line {n.lineno})" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _dotted(n.func) == "getattr" and len(n.args) == 3
            and _dotted(n.args[0]).rpartition(".")[2] in ("cfg", "config", "model")]


def test_memory_plan_and_programs_read_declared_fields():
    """The memory plan reads a model's widths from ``Model.widths`` (declared ``width_fields``),
    the programs the preset widening from ``Model.preset``: no guessed field names."""
    checked = [n for n in MODULES if n in ("fmoe.memory.plan", "fmoe.model") or layer_of(n) == 7]
    assert {n: f for n in checked for f in [guessed_fields(TREES[n])] if f} == {}
    old = ast.parse('g = lambda *names: next(getattr(cfg, n) for n in names if getattr(cfg, n, None))\n'
                    'kv = getattr(cfg, "num_key_value_heads", None)\n')
    assert sorted(guessed_fields(old)) == ["getattr(cfg, ...) (line 1)", "getattr(cfg, ...) (line 2)"]


# ------------------------------------------------------------------------------- choice by declared properties
def builtin_impl_names() -> set[str]:
    """The names ``fmoe/ep/__init__.py`` registers at import (``register("all_to_all", ...)``)."""
    return {node.value.args[0].value for node in TREES["fmoe.ep"].body
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _dotted(node.value.func) == "register"
            and node.value.args and isinstance(node.value.args[0], ast.Constant)}


def named_impls(tree: ast.AST, names: set) -> list[str]:
    """String constants (docstrings aside) equal to a built-in implementation's name: a choice
    made by name."""
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body]
    docs = {id(s.body[0].value) for s in scopes if isinstance(s.body[0], ast.Expr)}
    return [f"{node.value!r} (line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs]


def test_moe_chooses_the_implementation_by_declared_properties():
    """``fmoe.moe`` reads what the registry declares (``ep.declared``, ``ep.auto``), so a name
    registered again is never swapped for a built-in behind the user's back."""
    names = builtin_impl_names()
    assert names == {"local", "all_to_all", "all_reduce"}
    assert named_impls(TREES["fmoe.moe"], names) == []
    old = ast.parse('def _choose(impl, single):\n    """Pick "local"."""\n'
                    '    if single and impl in ("all_to_all", "all_reduce"):\n        return "local"\n    return impl\n')
    assert sorted(named_impls(old, names)) == ["'all_reduce' (line 3)", "'all_to_all' (line 3)", "'local' (line 4)"]


# ------------------------------------------------------------------------------- model files read like gpt-fast's
#: model file -> its length on 2026-12-01; a model file is at most 0.65 of it (issue 37)
MODEL_LINES_2026_12_01 = {"qwen3_moe": 326, "mixtral": 299, "gpt_oss": 324, "llama": 316, "deepseek_v3": 413}


def model_aliases(tree: ast.AST) -> list[str]:
    """Module-level assignments of a bare name or attribute, or a tuple of them: a second name for
    a function that lives elsewhere (``init_cache = _common.init_kv_cache``)."""
    bare = (ast.Name, ast.Attribute)
    return [f"{ast.unparse(node.targets[0])} (line {node.lineno})" for node in tree.body
            if isinstance(node, ast.Assign) and (isinstance(node.value, bare) or (
                isinstance(node.value, ast.Tuple) and all(isinstance(e, bare) for e in node.value.elts)))]


def layer_loop_problems(tree: ast.AST) -> list[str]:
    """What keeps ``forward`` from spelling its layer loop: no ``for`` over ``params["layers"]``
    in ``forward``, or a loop that calls no layer function of the module itself (``block``),
    or a ``block`` that calls neither the module's ``attention`` nor an FFN (``moe`` / ``mlp``)."""
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if "forward" not in funcs:
        return ["no forward"]
    loops = [n for n in ast.walk(funcs["forward"]) if isinstance(n, ast.For) and "params['layers']" in ast.unparse(n.iter)]
    called = {_dotted(c.func).rpartition(".")[2] for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call)}
    called |= {a.id for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call) for a in c.args
               if isinstance(a, ast.Name)}                         # remat.call("layer", block, ...)
    if not loops or "block" not in called or "block" not in funcs:
        return ["forward has no for loop over params['layers'] calling the module's block"]
    in_block = {_dotted(c.func).rpartition(".")[2] for c in ast.walk(funcs["block"]) if isinstance(c, ast.Call)}
    in_block |= {_dotted(a).rpartition(".")[2] for c in ast.walk(funcs["block"]) if isinstance(c, ast.Call) for a in c.args}
    return [] if "attention" in in_block and in_block & {"moe", "mlp"} else ["block calls no attention or FFN"]


def preset_methods(tree: ast.AST) -> list[str]:
    """A model ``Config`` whose presets are methods (``def tiny``) or that has no ``PRESETS`` table."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            found = [f"Config.{f.name} (line {f.lineno})" for f in node.body
                     if isinstance(f, ast.FunctionDef) and f.name in ("tiny", "small")]
            table = any(isinstance(a, ast.Assign) and _dotted(a.targets[0]) == "PRESETS" for a in node.body)
            return found + ([] if table else ["no Config.PRESETS"])
    return ["no Config"]


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_files_read_top_to_bottom(name):
    """A model file is its Config (presets as data), init, the layer loop in ``forward`` around
    its own ``block`` (attention, then the MoE or MLP), the plan and the name map: at most 0.65
    of its 2026-12-01 length (a family added later, OLMoE: of mixtral's, the shortest MoE file), and no alias lines (the shared methods come from ``MODEL`` through
    the module's ``__getattr__``)."""
    short = name.rpartition(".")[2]
    lines = MODULES[name].read_text().count("\n")
    then = MODEL_LINES_2026_12_01.get(short, MODEL_LINES_2026_12_01["mixtral"])  # a later family: mixtral's bound
    assert lines <= int(0.65 * then), f"{short}: {lines} lines"
    assert model_aliases(TREES[name]) == []
    assert layer_loop_problems(TREES[name]) == []
    assert preset_methods(TREES[name]) == []


def test_the_model_file_checks_catch_the_old_form():
    old = ast.parse("import fmoe\nclass Config:\n    @classmethod\n    def tiny(cls):\n        return cls()\n"
                    "def forward(params, tokens, cfg):\n    return _common.decoder(_attention, params, tokens, cfg)\n"
                    "init_cache = _common.init_kv_cache\n"
                    "check_plan, shard = MODEL.check_plan, MODEL.shard\nN, T = 3, (1, 2)\n")
    assert model_aliases(old) == ["init_cache (line 8)", "(check_plan, shard) (line 9)"]
    assert layer_loop_problems(old) == ["forward has no for loop over params['layers'] calling the module's block"]
    assert preset_methods(old) == ["Config.tiny (line 4)", "no Config.PRESETS"]
    assert layer_loop_problems(ast.parse(
        "def block(layer, x):\n    return x + layer\n"
        "def forward(params, x):\n    for layer in params[\"layers\"]:\n        x = block(layer, x)\n")) == [
        "block calls no attention or FFN"]


# ------------------------------------------------------------------------------- one home per concept
#: module name -> the package that is the one home of its concept (issue 37): a module of that
#: name anywhere else is a second home (``fmoe/memory_plan.py`` beside ``fmoe/dryrun/``, say).
CONCEPT_HOMES = {
    "memory_plan": "fmoe.memory", "memory_peak": "fmoe.memory", "fake_splits": "fmoe.experts",
    "dryrun": "fmoe.memory", "dry_run": "fmoe.memory", "tracker": "fmoe.memory", "memplan": "fmoe.memory",
    "placement": "fmoe.sharding", "dtensor_rules": "fmoe.sharding", "shard": "fmoe.sharding",
    "dtypes": "fmoe.precision", "tree_io": "fmoe.checkpoint", "steps": "fmoe.checkpoint",
}


def second_homes(modules) -> list[str]:
    """Modules named after a concept (:data:`CONCEPT_HOMES`) outside its home package."""
    return sorted(n for n in modules if n.startswith("fmoe.") and n.rpartition(".")[2] in CONCEPT_HOMES
                  and not n.startswith(CONCEPT_HOMES[n.rpartition(".")[2]] + "."))


def test_each_concept_has_one_home():
    """Memory estimation lives in ``fmoe/memory/`` (plan, peak, dry run), the fake-tensor split
    rule beside the experts it sizes (``fmoe/experts/fake_splits.py``), the
    placements in ``fmoe/sharding/``, tree I/O and step directories in ``fmoe/checkpoint/``,
    precision in ``fmoe/precision.py``."""
    assert second_homes(MODULES) == []
    assert {"fmoe.memory.plan", "fmoe.memory.dry_run", "fmoe.sharding.plan", "fmoe.checkpoint.tree_io"} <= set(MODULES)
    old = ["fmoe.memory_plan", "fmoe.memory_peak", "fmoe.fake_splits", "fmoe.dryrun", "fmoe.dryrun.tracker",
           "fmoe.memplan", "fmoe.placement", "fmoe.dtensor_rules", "fmoe.dtypes", "fmoe.tree_io", "fmoe.memory.plan"]
    assert second_homes(old) == sorted(old[:-1])


PRECISION_NAMES = {"at_least_f32", "upcast", "dtype_of", "compute_dtype", "DTYPES"}


def precision_defs(tree: ast.AST) -> list[str]:
    """Module-level definitions of the precision rule or the policy names (:data:`PRECISION_NAMES`),
    and tables that map ``"fp32"`` / ``"bf16"`` to torch dtypes."""
    found = []
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [_dotted(t) for t in node.targets] if isinstance(node, ast.Assign) else []
        found += [f"{n} (line {node.lineno})" for n in names if n in PRECISION_NAMES]
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and not set(names) & PRECISION_NAMES:
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            if {"fp32", "bf16"} <= keys:
                found.append(f"dtype table {names[0]} (line {node.lineno})")
    return found


def test_precision_lives_in_one_module():
    """The at-least-float32 rule and the policy names are defined once, in ``fmoe/precision.py``."""
    assert {n: f for n, t in TREES.items() if n != "fmoe.precision" for f in [precision_defs(t)] if f} == {}
    assert len(precision_defs(TREES["fmoe.precision"])) >= 4
    old = ast.parse('import torch\nDTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}\n'
                    'NAMES = {"fp32": 4, "bf16": 2}\ndef compute_dtype(name):\n    return DTYPES[name]\n')
    assert precision_defs(old) == ["DTYPES (line 2)", "dtype table NAMES (line 3)", "compute_dtype (line 4)"]


def local_shard_copies(tree: ast.AST) -> list[str]:
    """``t._local_tensor if isinstance(t, DTensor) else t`` (or ``t.to_local()``): the local
    shard of a maybe-DTensor written out instead of calling ``fmoe.sharding.local_shard``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.IfExp) and isinstance(node.test, ast.Call) and _dotted(node.test.func) == "isinstance"
                and len(node.test.args) == 2 and _dotted(node.test.args[1]).endswith("DTensor")):
            body = node.body.func if isinstance(node.body, ast.Call) else node.body
            if isinstance(body, ast.Attribute) and body.attr in ("_local_tensor", "to_local"):
                found.append(f"line {node.lineno}")
    return found


def step_dir_patterns(tree: ast.AST) -> list[str]:
    """String constants that spell the ``step-N`` directory pattern (a regex over ``step-``)."""
    return [f"line {n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and ("step-\\d" in n.value or "step-(\\d" in n.value)]


def test_one_helper_for_the_local_shard_and_one_for_step_directories():
    """``fmoe.sharding.local_shard`` is the one spelling of "this rank's storage of a leaf",
    ``fmoe/checkpoint/steps.py`` the one place the ``step-N`` pattern is written."""
    assert {n: f for n, t in TREES.items() if n != "fmoe.sharding.shard" for f in [local_shard_copies(t)] if f} == {}
    assert {n: f for n, t in TREES.items() if n != "fmoe.checkpoint.steps" for f in [step_dir_patterns(t)] if f} == {}
    assert step_dir_patterns(TREES["fmoe.checkpoint.steps"]) and local_shard_copies(TREES["fmoe.sharding.shard"])
    old = ast.parse('import re\nSTEP = re.compile(r"^step-(\\d+)$")\n'
                    'def f(t, g):\n    a = t._local_tensor if isinstance(t, DTensor) else t\n'
                    '    return g.to_local() if isinstance(g, DTensor) else g, re.match(r"step-\\d+", "x")\n')
    assert step_dir_patterns(old) == ["line 2", "line 5"] and local_shard_copies(old) == ["line 4", "line 5"]


def eager_imports(tree: ast.AST, name: str) -> list[str]:
    """Module-level imports (outside any function) of the submodule ``name`` in a package ``__init__``."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (
                node.module == name or (node.module is None and any(a.name == name for a in node.names))):
            found.append(f"line {node.lineno}")
        elif isinstance(node, ast.Import) and any(a.name == f"fmoe.{name}" for a in node.names):
            found.append(f"line {node.lineno}")
    return found


def test_import_fmoe_does_not_import_the_test_harness():
    """``fmoe/__init__.py`` imports ``fmoe.testing`` only on first use (``tests/unit/test_packaging.py``
    checks ``sys.modules`` in a fresh interpreter)."""
    assert eager_imports(TREES["fmoe"], "testing") == []
    old = ast.parse("from . import activations, testing, tree\nfrom .testing import spawn\n"
                    "def __getattr__(name):\n    from . import testing\n")
    assert eager_imports(old, "testing") == ["line 1", "line 2"]


# ------------------------------------------------------------------------------- size
TOP_LEVEL_MAX, LONG_LINES, LONG_MODULES_MAX = 24, 300, 3


def top_level_entries(folder: pathlib.Path) -> list[str]:
    """The files and folders at the top of ``folder`` (``__pycache__`` aside)."""
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")


def long_modules(texts: dict[str, str], limit: int = LONG_LINES) -> list[str]:
    """``name (N lines)`` of every module whose source is over ``limit`` lines."""
    return sorted(f"{n} ({len(t.splitlines())} lines)" for n, t in texts.items() if len(t.splitlines()) > limit)


def test_fmoe_top_level_has_at_most_24_entries(tmp_path):
    """A newcomer reads the top of ``fmoe/`` at a glance: each concept is one package or module."""
    entries = top_level_entries(ROOT / "fmoe")
    assert len(entries) <= TOP_LEVEL_MAX, (len(entries), entries)
    for name in ["__pycache__", "a.py", *(f"p{i}" for i in range(TOP_LEVEL_MAX))]:   # the rule can fail
        (tmp_path / name).mkdir()
    assert len(top_level_entries(tmp_path)) == TOP_LEVEL_MAX + 1


def test_at_most_three_modules_over_300_lines():
    """Modules stay near 300 lines (the docstring explains one concept); at most three of fmoe/ and
    models/ go over."""
    long = long_modules({n: p.read_text() for n, p in MODULES.items()})
    assert len(long) <= LONG_MODULES_MAX, long
    assert long_modules({"a": "x\n" * 301, "b": "x\n" * 300}) == ["a (301 lines)"]
