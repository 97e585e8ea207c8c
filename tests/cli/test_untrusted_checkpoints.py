"""Checkpoints and run directories as untrusted input: nothing read from disk is trusted, nothing
written follows a link, every interrupted run resumes, what was trained is what is exported and
decoded (with the weights alone).

One small qwen3_moe run (in this process) is trained once per module; each case copies it and
crafts what an attacker or a crash would leave: meta.json values, links in OUT, torn log rows,
stale temporaries. Usage errors are refused before anything starts (no training)."""

import errno
import json
import os
import shutil
import subprocess

import pytest
import torch

import fmoe
from fmoe.checkpoint import atomic
from fmoe.checkpoint import training as ckpt
from fmoe.checkpoint.config_check import config_from_dict, read_config
from fmoe.cli import train as cli
from fmoe.training import outdir, resume

BASE = ["--model", "qwen3_moe", "--batch", "2", "--seq", "16", "--quiet"]


def main(capsys, code, *args):
    try:
        got = cli.main(list(args))
    except SystemExit as e:
        got = e.code
    out = capsys.readouterr()
    assert got == code, out.err[-3000:]
    return out.err


def usage_error(capsys, *args):
    """The one ``fmoe train: error:`` line of a usage error (exit 2, before anything runs)."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(args))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step run with checkpoints step-1 and step-2 (and its log)."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    assert cli.main([*BASE, "--steps", "2", "--save-every", "1", "--out", out]) == 0
    return out


def copy_run(run, tmp_path, name="run"):
    dst = str(tmp_path / name)
    shutil.copytree(run, dst, symlinks=True)
    return dst


def edit_meta(path, settings=False, **changes):
    """Change meta.json's entries (``settings``: its recorded job settings, which a resume keeps)."""
    file = os.path.join(path, "meta.json")
    with open(file) as f:
        meta = json.load(f)
    for k, v in changes.items():
        where = meta["settings"] if settings else meta
        if v is KeyError:
            where.pop(k)
        else:
            where[k] = v
    with open(file, "w") as f:
        json.dump(meta, f)
    return file


# ------------------------------------------------------------ nothing from a checkpoint is run
def test_a_recorded_code_router_is_never_imported_and_kept_values_are_checked(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    step = os.path.join(out, "step-2")
    pwned = tmp_path / "PWNED"
    file = edit_meta(step, settings=True, router=f"os:system:command='touch {pwned}'")
    line = usage_error(capsys, "--resume", out, "--steps", "3")
    assert f"{file}: 'router' is \"os:system:command='touch {pwned}'\", code from module 'os'" in line
    assert "a checkpoint never chooses code" in line and not pwned.exists()
    # passed again explicitly, the user (not the checkpoint) names the code: the check lets it by
    ns = type("A", (), {"explicit": {"router"}, "router": "my.mod:fn"})()
    assert resume.check_router("my.mod:fn", ns, file) is None
    ns.explicit = set()
    assert "pass --router my.mod:fn again" in resume.check_router("my.mod:fn", ns, file)
    cases = {                                           # kept setting -> what the error names
        "lr": (float("nan"), "'settings.lr' is nan, not a value --lr accepts"),
        "clip": (-1.0, "'settings.clip' is -1.0, not a value --clip accepts"),
        "warmup": (-1, "'settings.warmup' is -1, not a value --warmup accepts"),
        "batch": ("4", "'settings.batch' is '4', not a value --batch accepts"),
        "seed": (True, "'settings.seed' is True, not a value --seed accepts"),
        "preset": ("huge", "'settings.preset' is 'huge', not a value --preset accepts"),
        "grad_accum": (0, "--grad-accum must be an integer >= 1, got 0"),
        "eval_seed": (-1, "'settings.eval_seed' is -1, not a value --eval-seed accepts"),
        "router": ("nosuch:k=2", "'nosuch' is not a built-in scheme"),
        "dp_batches": (KeyError, "meta.json's settings have no 'dp_batches'"),
    }
    for key, (value, want) in cases.items():
        shutil.rmtree(out)
        out = copy_run(run, tmp_path)
        edit_meta(os.path.join(out, "step-2"), settings=True, **{key: value})
        line = usage_error(capsys, "--resume", out, "--steps", "3")
        assert want in line and "meta.json" in line, (key, line)
    for key, value in (("lr", -1e-3), ("aux_weight", -0.5), ("aux_weight", float("inf"))):
        shutil.rmtree(out)
        out = copy_run(run, tmp_path)
        edit_meta(os.path.join(out, "step-2"), settings=True, **{key: value})
        line = usage_error(capsys, "--resume", out, "--steps", "3")
        assert "meta.json" in line and repr(value) in line, line


def test_a_crafted_model_config_is_refused_before_any_allocation(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    step = os.path.join(out, "step-2")
    with open(os.path.join(step, "meta.json")) as f:
        meta = json.load(f)
    hf = meta["hf_config"]
    for change, want in (({"head_dim": 4_000_000_000}, "'head_dim' must be an integer in [0, 2**24), got 4000000000"),
                         ({"hidden_size": 2 ** 20, "intermediate_size": 2 ** 20, "moe_intermediate_size": 2 ** 20},
                          "the fp32 parameters need"),
                         ({"num_hidden_layers": "2"}, "'num_hidden_layers' must be an integer")):
        edit_meta(step, hf_config={**hf, **change})
        line = usage_error(capsys, "--resume", out, "--steps", "3")
        assert want in line and "'hf_config'" in line, line
    with open(os.path.join(step, "meta.json"), "w") as f:   # a model fmoe does not ship: never imported
        json.dump({**meta, "settings": {**meta["settings"], "model": "nope"}}, f)
    assert "'model' is 'nope', not one of" in usage_error(capsys, "--resume", out, "--steps", "3")
    with open(os.path.join(step, "meta.json"), "w") as f:
        json.dump(meta, f)
    edit_meta(step, mesh="x")
    assert "'mesh' is 'x'" in usage_error(capsys, "--resume", out, "--steps", "3")
    edit_meta(step, mesh=meta["mesh"], hf_config=KeyError)
    assert "expected a JSON object (the model config), got NoneType" in usage_error(
        capsys, "--resume", out, "--steps", "3")
    # a --batch that cannot fit is refused by arithmetic, like the same value kept by a resume
    assert "one step's logits and their gradient need" in usage_error(capsys, *BASE, "--batch", str(10 ** 9))
    # the memory-plan --config reader and load_hf use the same checks
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]")
    from fmoe.models import qwen3_moe
    with pytest.raises(ValueError, match=r"list.json: expected a JSON object \(the model config\), got list"):
        read_config(qwen3_moe, str(bad))
    with pytest.raises(ValueError, match="'head_dim' must be an integer"):
        config_from_dict(qwen3_moe, {**hf, "head_dim": 4_000_000_000}, "config.json")
    from fmoe.models import llama
    export = str(tmp_path / "hf")
    llama.save_hf(llama.init(llama.Config.tiny()), llama.Config.tiny(), export)
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(export, "config.json"), "w") as f:
        json.dump({**config, "head_dim": 4_000_000_000}, f)
    with pytest.raises(ValueError, match=r"hf/config.json: 'head_dim' must be an integer in \[0, 2\*\*24\)"):
        llama.load_hf(export)                          # (generate and plan read configs the same way)


# --------------------------------------------------------------------------- no link followed
def test_links_in_out_are_refused_and_nothing_outside_is_touched(run, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in (".lock", "log.jsonl"):
        out = copy_run(run, tmp_path, f"run{name}")
        if os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
        os.symlink(victim, os.path.join(out, name))
        line = usage_error(capsys, "--resume", out, "--steps", "3")
        assert f"{name} is a symbolic link (to {str(victim)!r})" in line, line
    other = copy_run(run, tmp_path, "other")
    out = copy_run(run, tmp_path, "own")
    shutil.rmtree(os.path.join(out, "step-1"))
    os.symlink(os.path.join(other, "step-1"), os.path.join(out, "step-1"))
    line = usage_error(capsys, *BASE, "--steps", "2", "--out", out, "--overwrite")
    assert "step-1 is a symbolic link" in line
    assert sorted(os.listdir(out)) == ["log.jsonl", "step-1", "step-2"]            # nothing removed
    assert sorted(os.listdir(other)) == ["log.jsonl", "step-1", "step-2"]
    # the primitives refuse links themselves (a link planted after the checks)
    link = str(tmp_path / "log-link")
    os.symlink(victim, link)
    with pytest.raises(OSError, match="a symbolic link: fmoe never writes through one") as e:
        outdir.append_row(link, '{"step": 1}')
    assert e.value.errno == errno.ELOOP
    lock_dir = tmp_path / "locked"
    lock_dir.mkdir()
    os.symlink(victim, lock_dir / ".lock")
    with pytest.raises(OSError, match="is a symbolic link"):
        outdir.OutLock(str(lock_dir)).acquire()
    os.symlink(str(tmp_path / "other"), str(tmp_path / "ckpt-link"))
    with pytest.raises(ValueError, match="is a symbolic link"):
        atomic.begin(str(tmp_path / "ckpt-link"))
    from fmoe.data import write_shards
    with pytest.raises(ValueError, match="a symbolic link"):
        write_shards(str(tmp_path / "ckpt-link"), [], vocab_size=256)
    assert victim.read_text() == "precious"


# ---------------------------------------------------------------------- interrupted runs resume
def test_stale_temporaries_torn_rows_and_rows_after_the_checkpoint(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    shutil.rmtree(os.path.join(out, "step-2"))          # crashed after logging step 2, before saving it
    os.makedirs(os.path.join(out, ".step-2.tmp"))       # an old-style leftover of a killed save
    os.makedirs(os.path.join(out, ".step-2.tmp-999999999-abc"))        # and one of a process that is gone
    with open(os.path.join(out, "log.jsonl"), "a") as f:
        f.write('{"step": 3, "loss": 1.')                 # torn by a full disk
    err = main(capsys, 0, "--resume", out, "--steps", "3")   # no --out: continues in the run's own directory
    assert "dropped 1 unreadable row(s)" in err and "dropped 1 row(s) of steps after the checkpoint's step 1" in err
    assert sorted(os.listdir(out)) == ["log.jsonl", "step-1", "step-2", "step-3"]     # its --save-every 1 kept
    with open(os.path.join(out, "log.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]                # no step repeated
    assert not os.path.exists("runs/fmoe") or "step-3" not in os.listdir("runs/fmoe")


def test_a_finished_checkpoint_exports_without_training_and_quiet_keeps_warnings(run, tmp_path, capsys):
    out, hf = copy_run(run, tmp_path), str(tmp_path / "hf")
    err = main(capsys, 0, "--resume", out, "--steps", "2", "--export-hf", hf, "--memory-gb", "0.000001")
    assert "WARNING:" in err and "exceeds --memory-gb 1e-06" in err          # --quiet (kept) hides the table only
    assert sorted(os.listdir(out)) == ["log.jsonl", "step-1", "step-2"]      # no step trained, nothing saved
    with open(os.path.join(hf, "fmoe.json")) as f:
        assert json.load(f)["step"] == 2
    from fmoe.cli.generate import load as load_for_generate
    from fmoe.models import qwen3_moe
    exported, _ = qwen3_moe.load_hf(hf)
    trained = load_for_generate(out, fmoe.Mesh())[1]                      # step-2's parameters
    flat = fmoe.tree.flatten(trained)
    assert all(torch.equal(t, flat[p]) for p, t in fmoe.tree.flatten(exported).items())


def test_a_failed_save_removes_its_partial_directory_and_a_resave_replaces(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from fmoe.optim.adamw import init as adamw_init
    params = {"w": torch.arange(6.0).view(2, 3)}
    out = str(tmp_path / "run")
    ckpt.save(out, 1, params, adamw_init(params), {"note": "first"})
    ckpt.save(out, 1, params, adamw_init(params), {"note": "again"})              # a re-save of step-1
    assert sorted(os.listdir(out)) == ["step-1"] and ckpt.read_meta(os.path.join(out, "step-1"))["note"] == "again"
    real = dcp.save

    def full_disk(*a, **k):                              # fault injection: ENOSPC after some shards
        real(*a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError, match=f"no space left on device writing {out}/step-2"):
        ckpt.save(out, 2, params, adamw_init(params), {})
    assert sorted(os.listdir(out)) == ["step-1"]                                 # nothing partial left


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_log_row_on_a_real_full_disk_is_cut_back(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=64k"):
        pytest.skip("needs permission to mount a tmpfs (root in a privileged environment)")
    try:
        log = str(disk / "log.jsonl")
        outdir.append_row(log, json.dumps({"step": 1}))
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)     # fill the disk up to the last bytes
        try:
            while os.write(fd, b"x" * 512):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        row = json.dumps({"step": 2, "pad": "y" * 8000})
        with pytest.raises(OSError, match="writing .*log.jsonl") as e:
            outdir.append_row(log, row)
        assert e.value.errno == errno.ENOSPC
        with open(log) as f:
            assert f.read() == '{"step": 1}\n'                                   # no torn row
    finally:
        subprocess.run(["umount", str(disk)])


# --------------------------------------------------------------- what was trained is exported
def _bpe(path, words, vocab_size=300, special="[UNK]"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=special))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(words * 20, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return os.path.join(path, "tokenizer.json")


def test_export_and_generate_use_the_trained_router_and_the_datas_tokenizer(tmp_path, capsys):
    from fmoe.data import load_tokenizer, open_data, prepare
    from fmoe.cli.generate import load as load_for_generate
    from fmoe.cli.generate import main as generate_main
    from fmoe.models import qwen3_moe

    a = _bpe(str(tmp_path / "tok_a"), ["the quick brown fox", "jumps over the lazy dog", "mixture of experts"])
    b = _bpe(str(tmp_path / "tok_b"), ["the quick brown fox", "jumps over the lazy dog", "mixture of experts"],
             special="[OTHER]")                      # same vocabulary size, another tokenizer
    tok_a, tok_b = load_tokenizer(a), load_tokenizer(b)
    assert tok_a.vocab_size == tok_b.vocab_size and tok_a.digest != tok_b.digest
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    shards = str(tmp_path / "shards")
    prepare([str(tmp_path / "corpus.txt")], tok_a, shards, progress=False)
    with pytest.raises(ValueError, match="the shards were tokenized with .*tok_a.*not with tokenizer .*tok_b"):
        open_data(shards, tok_b)
    out, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    assert main(capsys, 0, *BASE, "--steps", "1", "--data", shards, "--router", "sigmoid_topk:k=2",
                "--out", out, "--export-hf", hf) == ""                   # no --tokenizer: the header's
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["fmoe_router"] == "sigmoid_topk:k=2"
    with open(os.path.join(hf, "fmoe.json")) as f:
        record = json.load(f)
    assert record["router"] == "sigmoid_topk:k=2" and record["tokenizer_digest"] == tok_a.digest
    with open(os.path.join(hf, "tokenizer.json"), "rb") as f, open(a, "rb") as g:
        assert f.read() == g.read()                                          # the data's tokenizer ships
    # generate decodes with the recorded router: the same logits as the trained forward with it
    mesh = fmoe.Mesh()
    models = [load_for_generate(ck, mesh) for ck in (out, hf)]
    tokens = torch.tensor([tok_a.encode("the quick brown")])
    for model, params, cfg, router, tok in models:
        assert tok.digest == tok_a.digest
        want = qwen3_moe.forward(params, tokens, cfg, router=fmoe.routing.sigmoid_topk(k=2))
        assert torch.equal(qwen3_moe.forward(params, tokens, cfg, router=router), want)
        assert not torch.allclose(qwen3_moe.forward(params, tokens, cfg), want)   # the model's own differs
    with pytest.raises(ValueError, match="decoding with another router is another model"):
        load_for_generate(hf, mesh, type("A", (), {"router": "topk:k=2", "tokenizer": None})())
    shutil.move(a, a + ".moved")                       # the recorded tokenizer is gone: one line, or --tokenizer
    assert generate_main(["--ckpt", out, "--prompt", "the fox", "--max-new-tokens", "2"]) == 1
    assert "is not there any more; pass --tokenizer T" in capsys.readouterr().err
    assert generate_main(["--ckpt", out, "--prompt", "the fox", "--max-new-tokens", "2", "--tokenizer", b]) == 1
    assert "is not the one the run used" in capsys.readouterr().err
    assert generate_main(["--ckpt", out, "--prompt", "the fox", "--max-new-tokens", "2",
                          "--tokenizer", a + ".moved"]) == 0
    assert capsys.readouterr().out.startswith("the fox")


def test_a_router_the_hf_config_can_say_runs_the_same_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from fmoe.data import load_tokenizer
    from fmoe.models import qwen3_moe
    from fmoe.training.export import export_hf, hf_router_fields

    assert hf_router_fields("mixtral", "topk:k=1,normalize=False") is None       # mixtral always renormalizes
    assert hf_router_fields("deepseek_v3", "sigmoid_topk:k=2,scale=2.5") == {"num_experts_per_tok": 2,
                                                                             "routed_scaling_factor": 2.5}
    cfg = qwen3_moe.Config.tiny()
    params = qwen3_moe.init(cfg, seed=3)
    path = str(tmp_path / "hf")
    export_hf(qwen3_moe, params, cfg, path, model_name="qwen3_moe", router="topk:k=1,normalize=False",
              tokenizer=load_tokenizer("bytes"), step=0)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert (config["num_experts_per_tok"], config["norm_topk_prob"]) == (1, False)
    tokens = torch.tensor([[5, 9, 13, 2, 7]])
    ours = qwen3_moe.forward(params, tokens, cfg, router=fmoe.routing.topk(1, normalize=False))
    theirs = AutoModelForCausalLM.from_pretrained(path).eval()(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_generate_refuses_bad_values_in_one_line(run, tmp_path, capsys):
    from fmoe.cli.generate import main as generate_main
    from fmoe.models import llama

    with pytest.raises(SystemExit) as e:
        generate_main(["--ckpt", run, "--prompt", "x", "--temperature", "nan"])
    assert e.value.code == 2 and "--temperature must be a finite number >= 0" in capsys.readouterr().err
    assert generate_main(["--ckpt", run, "--prompt", "x", "--max-new-tokens", str(10 ** 9)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lower max_new_tokens" in err[0]
    out = copy_run(run, tmp_path)
    edit_meta(os.path.join(out, "step-2"), model="nope")
    with pytest.raises(SystemExit) as e:                  # the model is chosen before any rank starts
        generate_main(["--ckpt", out, "--prompt", "x"])
    assert e.value.code == 2 and "'model' is 'nope', not one of" in capsys.readouterr().err
    edit_meta(os.path.join(out, "step-2"), model="qwen3_moe", hf_config=KeyError)
    assert generate_main(["--ckpt", out, "--prompt", "x"]) == 1
    assert "no 'hf_config'" in capsys.readouterr().err
    cfg = llama.Config.tiny()
    params = fmoe.tree.map_with_path(lambda p, t: t.fill_(float("nan")) if p.endswith("lm_head") else t,
                                     llama.init(cfg))
    llama.save_hf(params, cfg, str(tmp_path / "nan"))
    assert generate_main(["--ckpt", str(tmp_path / "nan"), "--prompt", "1 2"]) == 1
    assert "holds NaN/Inf values; refusing to generate" in capsys.readouterr().err


def test_generate_reads_the_weights_only(run, monkeypatch):
    """Decoding a training checkpoint builds no optimizer state: the weights equal a full load's."""
    import fmoe.optim.adamw as adamw
    from fmoe.cli.generate import load as load_for_generate

    with monkeypatch.context() as m:
        m.setattr(adamw, "init", lambda *a, **k: pytest.fail("fmoe generate built AdamW moments"))
        model, params, cfg, _, _ = load_for_generate(run, fmoe.Mesh())
    full = model.init(cfg)
    plan = model.build_plan(cfg, mesh=fmoe.Mesh(), params=full, data_parallel=True)
    ckpt.load(ckpt.latest(run), full, adamw.init(full), ckpt.packed_layout(plan, full))
    flat = fmoe.tree.flatten(full)
    assert all(torch.equal(t, flat[p]) for p, t in fmoe.tree.flatten(params).items())
