"""Checkpoints under attack (issue 14), in one process: writes that never destroy foreign files,
no pickle ever loaded, checksums, paths confined to the checkpoint directory, dtypes and sizes
checked at load, file modes of an export."""

import json
import os
import pickle
import shutil
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import fmoe
from fmoe.models import llama
from fmoe.checkpoint import training as ckpt
from fmoe.optim.adamw import init as adamw_init

CFG = llama.Config.tiny()


@pytest.fixture(scope="module")
def params():
    return llama.init(CFG, seed=0)


@pytest.fixture(scope="module")
def export(params, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "model")
    llama.save_hf(params, CFG, path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# -------------------------------------------------------------- writes never destroy foreign files
def test_save_hf_refuses_a_directory_with_other_files_and_overwrite_keeps_them(params, tmp_path, monkeypatch):
    run = tmp_path / "exp1"                      # what --out exp1 --export-hf exp1 used to wipe
    (run / "step-2").mkdir(parents=True)
    (run / "log.jsonl").write_text('{"step": 1}\n')
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not a checkpoint directory.*'log.jsonl'.*overwrite=True"):
        llama.save_hf(params, CFG, str(run))
    assert sorted(os.listdir(run)) == ["log.jsonl", "notes.txt", "step-2"]
    monkeypatch.chdir(tmp_path)                  # save_hf(params, cfg, ".") in a source directory
    (tmp_path / "train.py").write_text("print('hi')\n")
    with pytest.raises(ValueError, match="train.py"):
        llama.save_hf(params, CFG, ".")
    assert (tmp_path / "train.py").read_text() == "print('hi')\n"
    # overwrite=True: checkpoint files replaced, everything else kept, stale shards removed
    (run / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    llama.save_hf(params, CFG, str(run), overwrite=True)
    assert sorted(os.listdir(run)) == ["config.json", "log.jsonl", "model.safetensors", "notes.txt", "step-2"]
    assert (run / "notes.txt").read_text() == "mine"
    got, _ = llama.load_hf(str(run))
    assert all(torch.equal(a, b) for a, b in zip(fmoe.tree.leaves(got), fmoe.tree.leaves(params)))


def test_save_hf_replaces_an_existing_checkpoint_and_writes_public_modes(params, export, tmp_path):
    path = _copy(export, tmp_path / "again")
    old = os.umask(0o027)
    try:
        llama.save_hf(params, CFG, path)          # a checkpoint directory may be replaced as a whole
    finally:
        os.umask(old)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert os.stat(os.path.join(path, "model.safetensors")).st_mode & 0o777 == 0o640
    assert os.stat(path).st_mode & 0o777 == 0o750
    assert os.stat(os.path.join(export, "model.safetensors")).st_mode & 0o777 == 0o666 & ~old


# ------------------------------------------------------------------------- no pickle is ever read
class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FMOE_PWNED']}",))


def _train_ckpt(params, out):
    opt = adamw_init(params)
    return ckpt.save(out, 3, params, opt, {"note": "x"})


def test_a_planted_pickle_is_never_executed(params, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("FMOE_PWNED", str(marker))
    path = _train_ckpt(params, str(tmp_path / "run"))
    assert sorted(n for n in os.listdir(path) if not n.endswith(".safetensors")) == ["meta.json"]
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["format"] == ckpt.FORMAT and set(meta["files"]) == {n for n in os.listdir(path) if n != "meta.json"}
    with open(os.path.join(path, ".metadata"), "wb") as f:      # torch's FileSystemReader would unpickle this
        pickle.dump(_Payload(), f)
    fresh = llama.init(CFG, seed=1)
    planted = os.path.join(path, "shard-00009-model-00001-of-00001.safetensors")
    save_file({"params.norm": torch.zeros(64)}, planted)         # a tensor file fmoe did not write
    with pytest.raises(ValueError, match=r"shard-00009.*not listed in .*meta.json"):
        ckpt.load(path, fresh, adamw_init(fresh))
    os.remove(planted)
    # an old-format checkpoint (pickled .metadata + .distcp, meta.json without format) is refused
    legacy = tmp_path / "legacy" / "step-1"
    legacy.mkdir(parents=True)
    (legacy / "meta.json").write_text(json.dumps({"step": 1}))
    with open(legacy / ".metadata", "wb") as f:
        pickle.dump(_Payload(), f)
    with pytest.raises(ValueError, match="pickle-based"):
        ckpt.load(str(legacy), fresh, adamw_init(fresh))
    assert not marker.exists()
    ckpt.load(path, fresh, adamw_init(fresh))                   # loads, .metadata never opened
    assert all(torch.equal(a, b) for a, b in zip(fmoe.tree.leaves(fresh), fmoe.tree.leaves(params)))
    assert not marker.exists()


def _flip_last_byte(file):
    with open(file, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


# ------------------------------------------------------------------------------------ checksums
def test_a_flipped_bit_is_caught_on_resume_and_on_load_hf(params, export, tmp_path):
    path = _train_ckpt(params, str(tmp_path / "run"))
    shard = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    _flip_last_byte(os.path.join(path, shard))
    fresh = llama.init(CFG, seed=1)
    with pytest.raises(ValueError, match=rf"{shard}: SHA-256 differs"):
        ckpt.load(path, fresh, adamw_init(fresh))
    hf = _copy(export, tmp_path / "hf")
    _flip_last_byte(os.path.join(hf, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' does not match the SHA-256"):
        llama.load_hf(hf)


def test_non_finite_checkpoint_values_are_refused(params, tmp_path, monkeypatch):
    bad = fmoe.tree.map_with_path(lambda p, t: t.clone(), params)
    bad["layers"][1]["attn"]["wq"][0, 0] = float("nan")
    with pytest.raises(ckpt.NonFiniteState, match=r"first: rank 0: 'params\.layers\.1\.attn\.wq'.* was not written"):
        _train_ckpt(bad, str(tmp_path / "refused"))                   # nothing non-finite is saved
    assert not os.path.exists(tmp_path / "refused")                  # checked before anything is written
    with monkeypatch.context() as m:                                  # a writer without the check (a crafted file)
        m.setattr(ckpt, "first_nonfinite", lambda tree: None)
        path = _train_ckpt(bad, str(tmp_path / "run"))
    fresh = llama.init(CFG, seed=1)
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq' holds non-finite values"):
        ckpt.load(path, fresh, adamw_init(fresh))


def test_meta_step_must_be_a_non_negative_int(params, tmp_path):
    path = _train_ckpt(params, str(tmp_path / "run"))
    meta = json.load(open(os.path.join(path, "meta.json")))
    for step in (-3, 2.5, True, "4"):
        json.dump({**meta, "step": step}, open(os.path.join(path, "meta.json"), "w"))
        with pytest.raises(ValueError, match=r"'step' must be a non-negative integer"):
            ckpt.read_meta(path)


# ------------------------------------------------------------- paths stay inside the directory
def _indexed(export, dst, target):
    path = _copy(export, dst)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(tensors, os.path.join(path, "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    wm = {k: "model-00001-of-00001.safetensors" for k in tensors}
    wm[next(iter(wm))] = target
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return path, next(iter(wm))


def test_index_entries_cannot_leave_the_directory(export, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(os.path.join(export, "model.safetensors"), elsewhere / "x.safetensors")
    for i, target in enumerate(["../elsewhere/x.safetensors", str(elsewhere / "x.safetensors"), "/etc/passwd"]):
        path, key = _indexed(export, tmp_path / f"ck{i}", target)
        with pytest.raises(ValueError, match=rf"weight_map entry '{key}'.*must be a relative path inside"):
            llama.load_hf(path)
    path, key = _indexed(export, tmp_path / "link", "link.safetensors")
    os.symlink(elsewhere / "x.safetensors", os.path.join(path, "link.safetensors"))
    with pytest.raises(ValueError, match=rf"weight_map entry '{key}'.*symlink leading outside"):
        llama.load_hf(path)
    single = _copy(export, tmp_path / "single")
    os.remove(os.path.join(single, "model.safetensors"))
    os.symlink(elsewhere / "x.safetensors", os.path.join(single, "model.safetensors"))
    with pytest.raises(ValueError, match="symlink leading outside"):
        llama.load_hf(single)


def test_config_sizes_are_checked_against_the_tensors_before_building_layers(export, tmp_path):
    path = _copy(export, tmp_path / "huge")
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "num_hidden_layers": 200000}, open(os.path.join(path, "config.json"), "w"))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_hidden_layers is 200000 but the checkpoint's tensors hold 2 layers"):
        llama.load_hf(path)
    assert time.perf_counter() - t0 < 5


def test_qwen3_expert_count_is_checked_against_the_tensors(tmp_path):
    from fmoe.models import qwen3_moe
    cfg = qwen3_moe.Config.tiny()
    path = str(tmp_path / "q")
    qwen3_moe.save_hf(qwen3_moe.init(cfg), cfg, path)
    body = json.load(open(os.path.join(path, "config.json")))
    json.dump({**body, "num_experts": 100000}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=rf"num_experts is 100000 but the checkpoint's tensors hold {cfg.num_experts}"):
        qwen3_moe.load_hf(path)


# ------------------------------------------------------------------------------------- dtypes
def test_load_hf_dtype_and_mixed_or_integer_checkpoints(params, export, tmp_path):
    bf = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(export, "model.safetensors")).items()}
    path = _copy(export, tmp_path / "bf16")
    save_file(bf, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    got, _ = llama.load_hf(path)
    assert {t.dtype for t in fmoe.tree.leaves(got)} == {torch.bfloat16}
    got, _ = llama.load_hf(path, dtype=torch.float32)
    assert {t.dtype for t in fmoe.tree.leaves(got)} == {torch.float32}
    mixed = dict(bf, **{"model.norm.weight": bf["model.norm.weight"].float()})
    save_file(mixed, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mixes dtypes .*'model.norm.weight' is torch.float32.*dtype="):
        llama.load_hf(path)
    assert llama.load_hf(path, dtype=torch.float32)[0]["norm"].dtype == torch.float32
    ints = dict(bf, **{"lm_head.weight": torch.zeros_like(bf["lm_head.weight"], dtype=torch.int32)})
    save_file(ints, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'lm_head.weight' .* has dtype torch.int32; model parameters must be floating"):
        llama.load_hf(path, dtype=torch.float32)


def test_export_checksums_live_in_the_safetensors_header(export):
    with open(os.path.join(export, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    sums = json.loads(header["__metadata__"]["fmoe_sha256"])
    assert set(sums) == set(k for k in header if k != "__metadata__") and header["__metadata__"]["format"] == "pt"


@pytest.mark.parametrize("value,match", [
    ("{not json", "is not JSON"),
    ("7", "must be a JSON object .* got int 7"),
    ('{"model.embed_tokens.weight": 3}', "must be a JSON object .* got dict"),
])
def test_bad_checksum_metadata_names_the_file_and_the_key(export, tmp_path, value, match):
    hf = _copy(export, tmp_path / "hf")
    file = os.path.join(hf, "model.safetensors")
    tensors = load_file(file)
    save_file(tensors, file, metadata={"format": "pt", "fmoe_sha256": value})
    with pytest.raises(ValueError, match=rf"model.safetensors: safetensors metadata 'fmoe_sha256' {match}"):
        llama.load_hf(hf)
