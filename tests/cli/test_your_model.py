"""A model written outside fmoe is first class: every program takes it (issue 42).

The model lives in a temporary package outside the repository, on the public kit only (a copy of
the shipped Mixtral renamed ``byom_moe``, so transformers' ``MixtralForCausalLM`` checks its
export). ``fmoe train --model byom_pkg.byom_moe:MODEL --nproc 4 --ep 4`` trains it, ``--resume``
continues bitwise, ``--export-hf`` loads in transformers with equal logits, ``fmoe memory`` (and
``--dry-run``) plans it, ``fmoe generate`` decodes it, an entry point finds it by name, and every
bad ``--model`` is one line, exit 2, before any rank starts."""

import dataclasses
import importlib
import json
import os
import sys

import pytest
import torch

import fmoe
import fmoe.models
from fmoe.checkpoint import training as ckpt
from fmoe.training import JobConfig, run
from train_cases import read_log, train_cli

SPEC = "byom_pkg.byom_moe:MODEL"
RUN = ["--nproc", "4", "--ep", "4", "--batch", "2", "--seq", "16", "--quiet"]


def write_package(root, module="byom_moe", name="byom_moe"):
    """``byom_pkg/<module>.py`` under ``root``: the shipped Mixtral's source, renamed, public imports only."""
    src = open(fmoe.models.mixtral.__file__).read()
    assert "from . import" not in src and "fmoe.models._" not in src and "fmoe.model._" not in src   # public imports
    pkg = root / "byom_pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / f"{module}.py").write_text(src.replace('kit.Model("mixtral",', f'kit.Model("{name}",'))
    importlib.invalidate_caches()   # the path finder caches a directory's listing by its mtime (a coarse
    #                                 clock): a module written in the tick byom_pkg was last listed is unseen


def forget_package():
    """Drop ``byom_pkg`` and its modules from ``sys.modules``: a package imported from an earlier
    ``user_model`` (a module fixture set up again when xdist interleaves another file's tests) would
    still look for its modules in that fixture's folder."""
    for name in [n for n in sys.modules if n == "byom_pkg" or n.startswith("byom_pkg.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """The package on ``sys.path`` (spawned ranks take the caller's), and one 4-rank run of it."""
    root = tmp_path_factory.mktemp("outside")
    forget_package()
    write_package(root)
    (root / "byom_pkg" / "broken.py").write_text("raise ImportError('the user module is broken')\n")
    sys.path.insert(0, str(root))
    out = str(root / "run")
    train_cli("--model", SPEC, *RUN, "--steps", "3", "--save-every", "2", "--out", out, "--export-hf",
              str(root / "export"))
    yield root, out
    sys.path.remove(str(root))
    forget_package()


def test_train_resume_and_export(user_model, tmp_path):
    from transformers import MixtralForCausalLM

    root, out = user_model
    rows = read_log(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    meta = ckpt.read_meta(ckpt.latest(out))
    assert meta["model"] == SPEC and meta["settings"]["model"] == SPEC          # recorded as text
    again = str(tmp_path / "again")          # bitwise continuation; the library call takes the Model itself
    model = fmoe.models.get(SPEC)           # (registered by its name: the 4 spawned ranks receive it resolved)
    threads = torch.get_num_threads()
    try:
        run(JobConfig(model=model, resume=os.path.join(out, "step-2"), steps=3, out=again, quiet=True))
    finally:
        torch.set_num_threads(threads)
    assert [r["loss"] for r in read_log(again)] == [r["loss"] for r in rows[2:]]
    assert ckpt.read_meta(ckpt.latest(again))["model"] == "byom_moe"
    params, cfg = model.load_hf(str(root / "export"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = MixtralForCausalLM.from_pretrained(str(root / "export")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.forward(params, tokens, cfg), rtol=1e-5, atol=1e-5)


def test_memory_plans_it_with_and_without_a_dry_run(user_model, capsys):
    from fmoe.cli.memory import main

    assert main(["--model", SPEC, "--nproc", "4", "--ep", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["ranks"]) == 4 and plan["max_total_bytes"] > 0
    config = str(user_model[0] / "export" / "config.json")                     # model_type "mixtral"
    for flags, name in (([], "mixtral"), (["--model", SPEC], "byom_moe")):      # the registry, or --model
        assert main([*flags, "--config", config, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == name
    assert main(["--model", SPEC, "--batch", "1", "--seq", "8", "--dry-run", "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert all(r["measured"]["peak_bytes"] > 0 and r["planned"]["total_bytes"] > 0 for r in ranks)


def test_generate_decodes_it(user_model, capsys):
    from fmoe.cli.generate import main

    root, out = user_model
    export = str(root / "export")
    assert main(["--ckpt", export, "--model", SPEC, "--prompt", "ab", "--max-new-tokens", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["ids"]                              # byte tokens: "ab" is 97 98
    model = fmoe.models.get(SPEC)
    params, cfg = model.load_hf(export)
    assert got == fmoe.generate(model, params, cfg, [[97, 98]], 4)[0].tolist()           # greedy, as the library
    assert main(["--ckpt", out, "--model", SPEC, "--prompt", "ab", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == got                    # the training checkpoint: the same


def test_a_checkpoint_never_imports_the_model_it_names(user_model, capsys, tmp_path):
    """--resume and fmoe generate of a user model's checkpoint need --model; another model is refused by name."""
    from fmoe.cli.generate import main as generate

    _, out = user_model
    for flags, want in (([], f"'model' is '{SPEC}', not one of the models fmoe ships"),
                        (["--model", "mixtral"], f"'model' is '{SPEC}'; --model mixtral names another model")):
        res = train_cli(*flags, "--resume", out, "--steps", "4", "--out", str(tmp_path / "x"), check=False)
        assert res.returncode == 2 and want in res.stderr.strip().splitlines()[-1], res.stderr
        with pytest.raises(SystemExit) as e:
            generate(["--ckpt", out, *flags, "--prompt", "1"])
        assert e.value.code == 2 and want in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("spec,want", [
    ("byom_pkg.byom_moe:NOPE", "--model: model 'byom_pkg.byom_moe:NOPE': byom_pkg.byom_moe has no attribute NOPE"),
    ("byom_pkg.broken:MODEL", "importing byom_pkg.broken failed: ImportError: the user module is broken"),
    ("byom_pkg.byom_moe:init", "expected an fmoe.model.Model (or a module declaring MODEL = Model(...)), got a function"),
    ("byom_pkg.byom_moe:Config", "got a type"),
    ("nosuch_name", "unknown model 'nosuch_name'"),
])
def test_bad_models_are_one_line_usage_errors(user_model, capsys, tmp_path, spec, want):
    from fmoe.cli.generate import main as generate
    from fmoe.cli.memory import main as memory

    res = train_cli("--model", spec, *RUN, "--out", str(tmp_path / "run"), check=False)
    assert res.returncode == 2 and want in res.stderr.strip().splitlines()[-1], res.stderr
    assert not os.path.exists(tmp_path / "run")                                 # nothing started
    for program, argv in ((memory, ["--model", spec]), (generate, ["--ckpt", user_model[1], "--model", spec, "--prompt", "1"])):
        with pytest.raises(SystemExit) as e:
            program(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and want in err[-1], err
    with pytest.raises(ValueError, match="--model: "):
        JobConfig(model=spec)


def test_registered_and_entry_point_models(user_model, tmp_path, monkeypatch):
    """``register`` and the entry-point group ``fmoe.models``: found by name, entry points imported
    only when looked up, a broken one named while the others work, a name twice refused naming both."""
    root, _ = user_model
    write_package(root, "ep_moe", "ep_moe")
    dist = tmp_path / "byom-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: byom\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fmoe.models]\nep_moe = byom_pkg.ep_moe:MODEL\n"
                                           "broken = byom_pkg.broken:MODEL\nllama = byom_pkg.ep_moe:MODEL\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"ep_moe", "broken", "llama", "mixtral"} <= set(fmoe.models.names())
    assert "byom_pkg.ep_moe" not in sys.modules                                 # listed, not imported
    model = fmoe.models.get("ep_moe")
    assert model is sys.modules["byom_pkg.ep_moe"].MODEL and JobConfig(model="ep_moe").model == "ep_moe"
    with pytest.raises(ValueError, match=r"model 'broken': entry point broken = byom_pkg.broken:MODEL "
                                         r"\(distribution byom\) failed to load: ImportError: the user module is broken"):
        fmoe.models.get("broken")
    with pytest.raises(ValueError, match="'llama' is declared twice: by shipped fmoe.models.llama and by entry point "
                                         "llama = byom_pkg.ep_moe:MODEL"):
        fmoe.models.get("llama")
    assert fmoe.models.get("mixtral") is fmoe.models.mixtral.MODEL                # every other model usable
    # register(): a Model object in the library call is recorded by its name and found in this process
    write_package(root, "reg_moe", "reg_moe")
    import byom_pkg.reg_moe as reg

    assert JobConfig(model=reg.MODEL).model == "reg_moe" and fmoe.models.get("reg_moe") is reg.MODEL
    with pytest.raises(ValueError, match="model name 'ep_moe' is taken by entry point ep_moe = byom_pkg.ep_moe:MODEL"):
        fmoe.models.register(dataclasses.replace(reg.MODEL, name="ep_moe"))


def test_a_hugging_face_directory_names_its_model_by_model_type(user_model, tmp_path, capsys):
    """--init-hf and fmoe generate --ckpt HF_DIR look config.json's model_type up in the registry;
    a --model of another type, or a type no model registers, is one line, exit 2."""
    import shutil

    from fmoe.cli.generate import main as generate
    from fmoe.training.resolve import resolve

    export = str(user_model[0] / "export")                         # model_type "mixtral" (transformers' class)
    assert resolve(JobConfig(init_hf=export, out=str(tmp_path / "a"))).model == "mixtral"
    assert resolve(JobConfig(model=SPEC, init_hf=export, out=str(tmp_path / "b"))).model == SPEC
    res = train_cli("--model", "llama", "--init-hf", export, "--out", str(tmp_path / "c"), check=False)
    assert res.returncode == 2 and "model_type 'mixtral' is not the model_type of llama ('llama')" in res.stderr
    other = shutil.copytree(export, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "my_moe"}))
    want = "model_type 'my_moe' is not a model of fmoe.models"
    res = train_cli("--init-hf", str(other), "--out", str(tmp_path / "d"), check=False)
    assert res.returncode == 2 and want in res.stderr.strip().splitlines()[-1]
    with pytest.raises(SystemExit) as e:
        generate(["--ckpt", str(other), "--prompt", "1"])
    assert e.value.code == 2 and want in capsys.readouterr().err
