"""load_hf / save_hf on a toy model module: layouts, per-rank slice reads, round trips, atomicity, errors.

The toy model has dense weights (colwise, rowwise, a 2-D split, a nested (fsdp, tp) split), a
fused Cat weight on a packed placement, Qwen3-style per-expert keys stacked into
``w_gate_up [E, 2I, D]`` / ``w_down [E, D, I]``, and gpt-oss-style interleaved transposed
``gate_up_proj`` with its bias. Expected parameters are computed from the HF tensors with plain
torch ops, independently of the spec code.
"""

import dataclasses
import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import fmoe
from fmoe import P, Plan
from fmoe.checkpoint import Cat, Checkpoint, Deinterleave, Key, Stack, Transpose, load_hf, save_hf
from fmoe.testing import spawn
from helpers import on_ranks


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab: int = 16
    dim: int = 8
    inter: int = 4
    experts: int = 4

    @classmethod
    def from_hf(cls, d):
        return cls(d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_experts"])

    def to_hf(self):
        return {"model_type": "toy_moe", "architectures": ["ToyMoeForCausalLM"], "vocab_size": self.vocab,
                "hidden_size": self.dim, "intermediate_size": self.inter, "num_experts": self.experts}


def toy_hf_specs(cfg, keys=None):
    V, D, I, E = cfg.vocab, cfg.dim, cfg.inter, cfg.experts
    L0, L1 = "model.layers.0", "model.layers.1"
    fused = keys is not None and f"{L0}.mlp.experts.gate_up_proj" in keys
    if fused:     # the fused expert layout transformers holds in memory
        moe0 = {"w_gate_up": Key(f"{L0}.mlp.experts.gate_up_proj", (E, 2 * I, D)),
                "w_down": Key(f"{L0}.mlp.experts.down_proj", (E, D, I))}
    else:         # per-expert keys, as save_pretrained writes them
        ex = lambda n, s: Stack([Key(f"{L0}.mlp.experts.{e}.{n}.weight", s) for e in range(E)])  # noqa: E731
        moe0 = {"w_gate_up": Cat([ex("gate_proj", (I, D)), ex("up_proj", (I, D))], dim=1),
                "w_down": ex("down_proj", (D, I))}
    return {
        "embed": Key("model.embed_tokens.weight", (V, D)),
        "layers.0.wq": Key(f"{L0}.self_attn.q_proj.weight", (D, D)),
        "layers.0.wo": Key(f"{L0}.self_attn.o_proj.weight", (D, D)),
        "layers.0.w_gate_up": Cat([Key(f"{L0}.mlp.gate_proj.weight", (I, D)), Key(f"{L0}.mlp.up_proj.weight", (I, D))], 0),
        **{f"layers.0.moe.{k}": v for k, v in moe0.items()},
        "layers.1.moe.w_gate_up": Transpose(Deinterleave(Key(f"{L1}.mlp.experts.gate_up_proj", (E, D, 2 * I)), 2), 1, 2),
        "layers.1.moe.b_gate_up": Deinterleave(Key(f"{L1}.mlp.experts.gate_up_proj_bias", (E, 2 * I)), 1),
        "layers.1.moe.w_down": Transpose(Key(f"{L1}.mlp.experts.down_proj", (E, I, D)), 1, 2),
        "norm": Key("model.norm.weight", (D,)),
        "lm_head": Key("lm_head.weight", (V, D)),
    }


PLAN = {"embed": P(("fsdp", "tp"), None), "layers.0.wq": "colwise", "layers.0.wo": "rowwise",
        "layers.0.w_gate_up": P("tp", "fsdp", packed=2), "layers.*.moe.w_down": P("ep", None, None),
        "layers.0.moe.w_gate_up": P("ep", None, None), "layers.1.moe.w_gate_up": P(None, "tp", None, packed=2),
        "layers.1.moe.b_gate_up": P(None, "tp", packed=2), "norm": P(), "lm_head": P("fsdp", "tp")}

toy = types.SimpleNamespace(__name__="toy", Config=ToyConfig, hf_specs=toy_hf_specs,
                            plan=lambda cfg: Plan(PLAN), HF_IGNORE=("**.inv_freq",))
CFG = ToyConfig()


def hf_tensors(cfg=CFG, seed=0):
    g = torch.Generator().manual_seed(seed)
    V, D, I, E = cfg.vocab, cfg.dim, cfg.inter, cfg.experts
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    L0, L1 = "model.layers.0", "model.layers.1"
    out = {"model.embed_tokens.weight": r(V, D), f"{L0}.self_attn.q_proj.weight": r(D, D),
           f"{L0}.self_attn.o_proj.weight": r(D, D), f"{L0}.mlp.gate_proj.weight": r(I, D),
           f"{L0}.mlp.up_proj.weight": r(I, D), f"{L1}.mlp.experts.gate_up_proj": r(E, D, 2 * I),
           f"{L1}.mlp.experts.gate_up_proj_bias": r(E, 2 * I), f"{L1}.mlp.experts.down_proj": r(E, I, D),
           "model.norm.weight": r(D), "lm_head.weight": r(V, D), "model.rotary_emb.inv_freq": r(2)}
    for e in range(E):
        for n, s in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            out[f"{L0}.mlp.experts.{e}.{n}.weight"] = r(*s)
    return out


def expected_params(hf, cfg=CFG):
    L0, L1 = "model.layers.0", "model.layers.1"
    ex = lambda e, n: hf[f"{L0}.mlp.experts.{e}.{n}.weight"]  # noqa: E731
    gu, b = hf[f"{L1}.mlp.experts.gate_up_proj"], hf[f"{L1}.mlp.experts.gate_up_proj_bias"]
    return {
        "embed": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"], "lm_head": hf["lm_head.weight"],
        "layers": [
            {"wq": hf[f"{L0}.self_attn.q_proj.weight"], "wo": hf[f"{L0}.self_attn.o_proj.weight"],
             "w_gate_up": torch.cat([hf[f"{L0}.mlp.gate_proj.weight"], hf[f"{L0}.mlp.up_proj.weight"]]),
             "moe": {"w_gate_up": torch.stack([torch.cat([ex(e, "gate_proj"), ex(e, "up_proj")]) for e in range(cfg.experts)]),
                     "w_down": torch.stack([ex(e, "down_proj") for e in range(cfg.experts)])}},
            {"moe": {"w_gate_up": torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2).contiguous(),
                     "b_gate_up": torch.cat([b[:, 0::2], b[:, 1::2]], -1),
                     "w_down": hf[f"{L1}.mlp.experts.down_proj"].transpose(1, 2).contiguous()}}],
    }


def fused_layout(hf):
    """The same weights with layer 0's experts as fused keys (the in-memory transformers layout)."""
    E, L0 = CFG.experts, "model.layers.0"
    want = expected_params(hf)["layers"][0]["moe"]
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k or not k.startswith(L0)}
    out[f"{L0}.mlp.experts.gate_up_proj"], out[f"{L0}.mlp.experts.down_proj"] = want["w_gate_up"], want["w_down"]
    assert len(out) == len(hf) - 3 * E + 2
    return out


def write_dir(path, hf, sharded=False, config=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config if config is not None else CFG.to_hf(), f)
    if not sharded:
        save_file(hf, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = sorted(hf)
    files = {f"model-0000{i + 1}-of-00003.safetensors": keys[i::3] for i in range(3)}
    for name, ks in files.items():
        save_file({k: hf[k] for k in ks}, os.path.join(path, name), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: n for n, ks in files.items() for k in ks}}, f)
    return path


def data_bytes(hf, ignore=("model.rotary_emb.inv_freq",)):
    return sum(v.numel() * v.element_size() for k, v in hf.items() if k not in ignore)


def assert_trees_equal(a, b):
    fa, fb = fmoe.tree.flatten(a), fmoe.tree.flatten(b)
    assert list(fa) == list(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf = hf_tensors()
    return {"hf": hf, "single": write_dir(str(root / "single"), hf),
            "sharded": write_dir(str(root / "sharded"), hf, sharded=True),
            "fused": write_dir(str(root / "fused"), fused_layout(hf))}


# ------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("layout", ["single", "sharded", "fused"])
def test_full_load_every_layout(dirs, layout):
    with Checkpoint(dirs[layout]) as ck:
        params, cfg = load_hf(toy, ck)
        assert ck.bytes_read == data_bytes(dirs["hf"])      # every tensor once, inv_freq never
    assert cfg == CFG
    assert_trees_equal(params, expected_params(dirs["hf"]))
    one, _ = load_hf(toy, dirs[layout], mesh=fmoe.Mesh())   # a one-process mesh: same plain tensors
    assert_trees_equal(one, params)
    with Checkpoint(dirs[layout]) as ck:                    # a bad plan fails before anything is read
        with pytest.raises(ValueError, match="'nope' matches no parameter"):
            load_hf(toy, ck, mesh=fmoe.Mesh(), plan=Plan(PLAN).override({"nope": P()}))
        assert ck.bytes_read == 0
    as64, _ = load_hf(toy, dirs[layout], dtype=torch.float64)
    assert as64["norm"].dtype == torch.float64 and torch.equal(as64["norm"], params["norm"].double())


def test_save_load_round_trip_single_and_sharded_files(dirs, tmp_path):
    params = expected_params(dirs["hf"])
    out = str(tmp_path / "out")
    save_hf(toy, params, CFG, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]                   # no temporary directory left
    written = load_file(os.path.join(out, "model.safetensors"))
    want = {k: v for k, v in dirs["hf"].items() if k != "model.rotary_emb.inv_freq"}
    assert sorted(written) == sorted(want) and all(torch.equal(written[k], want[k]) for k in want)
    assert json.load(open(os.path.join(out, "config.json"))) == CFG.to_hf()
    back, cfg = load_hf(toy, out)
    assert cfg == CFG
    assert_trees_equal(back, params)
    # small shards: numbered files + index, in the transformers naming; saving over `out` replaces it
    save_hf(toy, params, CFG, out, max_shard_size=600)
    files = sorted(os.listdir(out))
    n = len(files) - 2
    assert n > 2 and files == ["config.json"] + [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] \
        + ["model.safetensors.index.json"]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(want) and index["metadata"]["total_size"] == data_bytes(want)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    back, _ = load_hf(toy, out)
    assert_trees_equal(back, params)


def test_failed_save_keeps_the_old_checkpoint_and_leaves_nothing(dirs, tmp_path, monkeypatch):
    import safetensors.torch

    out = str(tmp_path / "ckpt")
    params = expected_params(dirs["hf"])
    save_hf(toy, params, CFG, out)
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    real, calls = safetensors.torch.save_file, []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) % 2 == 0:                   # one shard file already written in the temp dir
            assert os.path.dirname(filename) != out and os.path.exists(calls[-2])
            raise OSError("disk full (simulated)")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    zeros = fmoe.tree.map_with_path(lambda _, t: torch.zeros_like(t), params)
    with pytest.raises(OSError, match="disk full"):
        save_hf(toy, zeros, CFG, out, max_shard_size=600)
    assert len(calls) == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]            # temp dir removed
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before
    assert_trees_equal(load_hf(toy, out)[0], params)
    with pytest.raises(OSError, match="disk full"):          # a first save fails: nothing at all appears
        save_hf(toy, zeros, CFG, str(tmp_path / "new"), max_shard_size=600)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_replacing_without_renameat2_exchange(dirs, tmp_path, monkeypatch):
    import fmoe.checkpoint.fs as fs

    monkeypatch.setattr(fs, "exchange", lambda a, b: False)   # e.g. a filesystem without it
    out = str(tmp_path / "ckpt")
    params = expected_params(dirs["hf"])
    save_hf(toy, fmoe.tree.map_with_path(lambda _, t: torch.zeros_like(t), params), CFG, out)
    save_hf(toy, params, CFG, out)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_trees_equal(load_hf(toy, out)[0], params)


def _killed_save(rank, world, out, params):
    import signal

    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def save_then_die(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)         # killed mid-save, one shard file written
        real(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_then_die
    zeros = fmoe.tree.map_with_path(lambda _, t: torch.zeros_like(t), params)
    save_hf(toy, zeros, CFG, out, max_shard_size=600)


def test_killed_save_leaves_the_old_checkpoint_loadable(dirs, tmp_path):
    out = str(tmp_path / "ckpt")
    params = expected_params(dirs["hf"])
    save_hf(toy, params, CFG, out)
    with pytest.raises(RuntimeError, match="rank 0 died"):
        spawn(_killed_save, 1, out, params, timeout=60)
    left = set(os.listdir(tmp_path)) - {"ckpt"}
    assert len(left) == 1 and left.pop().startswith(".ckpt.tmp-")     # only the dead save's hidden temp dir
    assert_trees_equal(load_hf(toy, out)[0], params)
    save_hf(toy, params, CFG, out)                        # the next save clears the dead save's leftover
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# ------------------------------------------------------------------------------ errors
def _with(tmp_path, name, hf=None, **kw):
    return write_dir(str(tmp_path / name), hf if hf is not None else hf_tensors(), **kw)


def test_directory_and_file_errors_name_the_path(dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory '.*nowhere' does not exist"):
        load_hf(toy, str(tmp_path / "nowhere"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_hf(toy, str(tmp_path / "file"))
    d = _with(tmp_path, "noconfig")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match="noconfig' has no config.json"):
        load_hf(toy, d)
    d = _with(tmp_path, "badjson")
    open(os.path.join(d, "config.json"), "w").write("{not json")
    with pytest.raises(ValueError, match=r"badjson/config.json: not valid JSON"):
        load_hf(toy, d)
    d = _with(tmp_path, "noweights")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"noweights' has neither model.safetensors nor model.safetensors.index.json"):
        load_hf(toy, d)
    d = _with(tmp_path, "lostshard", sharded=True)
    os.remove(os.path.join(d, "model-00002-of-00003.safetensors"))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors: shard file named by .*index.json does not exist"):
        load_hf(toy, d)
    d = _with(tmp_path, "badindex", sharded=True)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert index["weight_map"]["lm_head.weight"] == "model-00001-of-00003.safetensors"
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00003.safetensors"
    json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors: .* maps 1 key\(s\) to this file but it "
                                         r"does not hold them: \['lm_head.weight'\]"):
        load_hf(toy, d)


def test_truncated_or_corrupt_file_is_named(tmp_path):
    for name, cut in (("truncated", lambda b: b[:-100]), ("corrupt", lambda b: b"\xff" * 8 + b[8:]),
                      ("empty", lambda b: b"")):
        d = _with(tmp_path, name, sharded=True)
        f = os.path.join(d, "model-00003-of-00003.safetensors")
        data = open(f, "rb").read()
        open(f, "wb").write(cut(data))
        with pytest.raises(ValueError, match=rf"{name}/model-00003-of-00003.safetensors: unreadable safetensors "
                                             "file, truncated or corrupt"):
            load_hf(toy, d)


def test_missing_unexpected_misshaped_keys_and_config_mismatch(tmp_path):
    hf = hf_tensors()
    del hf["model.layers.0.mlp.experts.2.up_proj.weight"]
    hf["model.layers.0.extra.weight"] = torch.zeros(2)
    hf["lm_head.weight"] = torch.zeros(CFG.vocab + 1, CFG.dim)
    d = _with(tmp_path, "keys", hf)
    with pytest.raises(ValueError) as e:
        load_hf(toy, d)
    msg = str(e.value)
    assert "keys' does not match toy" in msg
    assert "1 missing key(s): 'model.layers.0.mlp.experts.2.up_proj.weight' (for 'layers.0.moe.w_gate_up', shape (4, 8))" in msg
    assert "1 mis-shaped key(s): 'lm_head.weight' in model.safetensors has shape (17, 8), the config implies (16, 8)" in msg
    assert "1 unexpected key(s)" in msg and "'model.layers.0.extra.weight' in model.safetensors" in msg
    assert "inv_freq" not in msg                           # ignored by toy.HF_IGNORE
    d = _with(tmp_path, "otherconfig", config={**CFG.to_hf(), "model_type": "llama"})
    with pytest.raises(ValueError, match="otherconfig/config.json: model_type is 'llama' but toy loads model_type 'toy_moe'"):
        load_hf(toy, d)
    d = _with(tmp_path, "shortconfig", config={"model_type": "toy_moe"})
    with pytest.raises(ValueError, match=r"shortconfig/config.json: not a valid toy config \(KeyError: 'vocab_size'\)"):
        load_hf(toy, d)
    d = _with(tmp_path, "mixed", {**hf_tensors(), "model.layers.0.mlp.up_proj.weight": torch.zeros(4, 8, dtype=torch.float16)})
    with pytest.raises(ValueError, match="different dtypes .*'model.layers.0.mlp.up_proj.weight': 'torch.float16'"):
        load_hf(toy, d)


def test_save_rejects_bad_input_before_writing(dirs, tmp_path):
    params = expected_params(dirs["hf"])
    out = str(tmp_path / "out")
    bad = {**params, "norm": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"params\['norm'\] has shape \(3,\), the config implies \(8,\)"):
        save_hf(toy, bad, CFG, out)
    with pytest.raises(ValueError, match=r"missing \['lm_head'\], unexpected \['extra'\]"):
        save_hf(toy, {**{k: v for k, v in params.items() if k != "lm_head"}, "extra": torch.zeros(1)}, CFG, out)
    with pytest.raises(TypeError, match=r"params\['norm'\] must be a tensor, got float"):
        save_hf(toy, {**params, "norm": 1.0}, CFG, out)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile' exists and is not a directory"):
        save_hf(toy, params, CFG, str(tmp_path / "afile"))
    with pytest.raises(ValueError, match="max_shard_size must be a positive int of bytes or a string like '50GB'"):
        save_hf(toy, params, CFG, out, max_shard_size="lots")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


# ------------------------------------------------------------------------------ 4 ranks
def _distributed(rank, world, dirs, out_dir, grad_dir):
    mesh = fmoe.Mesh(tp=2, ep=4)                       # fsdp=2, efsdp=1
    hf = dirs["hf"]
    full = expected_params(hf)
    ref = fmoe.shard(full, Plan(PLAN), mesh)
    res = {}
    for layout in ("single", "sharded", "fused"):
        with Checkpoint(dirs[layout]) as ck:
            params, cfg = load_hf(toy, ck, mesh)
            read = ck.bytes_read
        got, want = fmoe.tree.flatten(params), fmoe.tree.flatten(ref)
        same = {k: (isinstance(got[k], DTensor) and got[k].shape == want[k].shape
                    and got[k].placements == want[k].placements and got[k].device_mesh == want[k].device_mesh
                    and fmoe.placement_of(got[k]) == fmoe.placement_of(want[k])
                    and torch.equal(got[k].to_local(), want[k].to_local())) for k in want}
        local_bytes = sum(t.to_local().numel() * 4 for t in got.values())
        res[layout] = (same, read, local_bytes, cfg == CFG)
    # save from DTensors (rank 0 writes) then read back full on every rank
    save_hf(toy, params, cfg, out_dir)
    back, _ = load_hf(toy, out_dir)
    written = load_file(os.path.join(out_dir, "model.safetensors"))
    res["save"] = (all(torch.equal(a, b) for a, b in zip(fmoe.tree.leaves(back), fmoe.tree.leaves(full))),
                   sorted(written) == sorted(k for k in hf if "inv_freq" not in k)
                   and all(torch.equal(written[k], hf[k]) for k in written))
    # a gradient tree (same structure, DTensor grads) saves the same way
    for t in fmoe.tree.leaves(params):
        t.requires_grad_(True)
    sum((fmoe.to_local(t) * 2).sum() for t in fmoe.tree.leaves(params)).backward()
    grad_tree = fmoe.tree.map_with_path(lambda _, t: t.grad, params)
    save_hf(toy, grad_tree, cfg, grad_dir)
    grads, _ = load_hf(toy, grad_dir)
    # honest placements: a leaf replicated over fsdp holds a pending sum of the 2 batches' 2.0
    want = fmoe.tree.leaves(fmoe.gather(grad_tree))
    res["grads"] = (all(torch.equal(g, w) for g, w in zip(fmoe.tree.leaves(grads), want))
                    and all(torch.equal(w, torch.full_like(w, w.flatten()[0])) and w.flatten()[0] in (2.0, 4.0)
                            for w in want))
    # a bad plan fails on every rank before a byte is read
    with Checkpoint(dirs["single"]) as ck:
        try:
            load_hf(toy, ck, mesh, plan=Plan(PLAN).override({"layers.9.wq": "colwise"}))
            res["bad_plan"] = None
        except ValueError as e:
            res["bad_plan"] = (str(e), ck.bytes_read)
    return res


def test_sharded_load_reads_only_own_slices_and_equals_shard(dirs, tmp_path):
    total = data_bytes(dirs["hf"])
    results = on_ranks(_distributed, 4, dirs, str(tmp_path / "out"), str(tmp_path / "grads"), timeout=180)
    for rank, res in enumerate(results):
        for layout in ("single", "sharded", "fused"):
            same, read, local_bytes, cfg_ok = res[layout]
            assert cfg_ok and all(same.values()), (rank, layout, [k for k, v in same.items() if not v])
            assert read == local_bytes < total / 2, (rank, layout, read, local_bytes, total)
        assert res["save"] == (True, True), rank
        assert res["grads"], rank
        msg, read = res["bad_plan"]
        assert "'layers.9.wq' matches no parameter" in msg and read == 0
    assert sorted(os.listdir(tmp_path)) == ["grads", "out"]
