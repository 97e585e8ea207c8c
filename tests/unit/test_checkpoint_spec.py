"""Source specs: read(index) == full[index] on every node type, reading only the elements asked for."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from fmoe.checkpoint import Cat, Checkpoint, Deinterleave, Key, Stack, Transpose
from fmoe.checkpoint.spec import normalize_index

G = torch.Generator().manual_seed(0)
HF = {"a": torch.randn(5, 3, generator=G), "b": torch.randn(2, 3, generator=G), "c": torch.randn(4, 3, generator=G),
      **{f"{n}{e}": torch.randn(3, 4, generator=G) for n in ("e", "u") for e in range(3)},
      "il": torch.randn(2, 3, 12, generator=G), "bias": torch.randn(2, 12, generator=G)}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    save_file(HF, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    with Checkpoint(d) as c:
        yield c


def K(name):
    return Key(name, HF[name].shape)


def deinterleave(t, dim, n):   # independent of the spec code: strided views, concatenated
    return torch.cat([t.movedim(dim, 0)[k::n].movedim(0, dim) for k in range(n)], dim)


E = [K("e0"), K("e1"), K("e2")]
U = [K("u0"), K("u1"), K("u2")]
CASES = {
    "key": (K("a"), HF["a"]),
    "cat0": (Cat([K("a"), K("b"), K("c")], 0), torch.cat([HF["a"], HF["b"], HF["c"]])),
    "cat1_of_stacks": (Cat([Stack(E), Stack(U)], dim=1),        # Qwen3-MoE w_gate_up [E, 2I, D]
                       torch.cat([torch.stack([HF[k] for k in ("e0", "e1", "e2")]),
                                  torch.stack([HF[k] for k in ("u0", "u1", "u2")])], 1)),
    "stack_mid": (Stack(E, dim=1), torch.stack([HF[k] for k in ("e0", "e1", "e2")], 1)),
    "stack_last": (Stack(E, dim=-1), torch.stack([HF[k] for k in ("e0", "e1", "e2")], -1)),
    "transpose": (Transpose(K("il"), 1, 2), HF["il"].transpose(1, 2)),
    "deinterleave2": (Deinterleave(K("il"), dim=2), deinterleave(HF["il"], 2, 2)),
    "deinterleave3": (Deinterleave(K("il"), dim=-1, n=3), deinterleave(HF["il"], 2, 3)),
    "gpt_oss_gate_up": (Transpose(Deinterleave(K("il"), 2), 1, 2), deinterleave(HF["il"], 2, 2).transpose(1, 2)),
    "gpt_oss_bias": (Deinterleave(K("bias"), 1), deinterleave(HF["bias"], 1, 2)),
    "deinterleave_of_cat": (Deinterleave(Cat([K("a"), K("c")], 0), 0, 3), deinterleave(torch.cat([HF["a"], HF["c"]]), 0, 3)),
}


def random_index(shape, rng):
    idx = []
    for n in shape:
        a = rng.randrange(0, n + 1)
        b = rng.randrange(a, n + 1)
        idx.append(slice(a, b, rng.choice([None, 1, 1, 2, 3])))
    return tuple(idx[:rng.randrange(0, len(shape) + 1)]) if rng.random() < 0.2 else tuple(idx)


@pytest.mark.parametrize("name", sorted(CASES))
def test_read_any_block_equals_full_block(ck, name):
    spec, want = CASES[name]
    spec = spec.bind(ck)
    assert spec.shape == tuple(want.shape) and spec.dtype == torch.float32
    assert torch.equal(spec.read(), want)
    rng = random.Random(name)
    for _ in range(40):
        idx = random_index(spec.shape, rng)
        before = ck.bytes_read
        got = spec.read(idx)
        assert torch.equal(got, want[idx]), (name, idx)
        assert ck.bytes_read - before == got.numel() * 4, (name, idx)    # exactly the block


def test_packed_tp_slice_of_interleaved_weight_reads_exactly_its_bytes(ck):
    # tp rank 1 of 2 with a packed [gate | up] placement reads [gate rows 3:6 | up rows 3:6]:
    # interleaved positions 6, 8, 10 and 7, 9, 11 (two strided reads), nothing else
    spec = Transpose(Deinterleave(K("il"), 2), 1, 2).bind(ck)          # [2, 12, 3]
    before = ck.bytes_read
    parts = [spec.read((slice(None), slice(3, 6))), spec.read((slice(None), slice(9, 12)))]
    assert ck.bytes_read - before == 2 * 2 * 3 * 3 * 4
    full = spec.read()
    assert torch.equal(torch.cat(parts, 1), torch.cat([full[:, 3:6], full[:, 9:12]], 1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_is_the_inverse(name):
    spec, want = CASES[name]
    out = spec.split(want)
    names = [k.name for k in spec.leaves()]
    assert sorted(out) == sorted(set(names))
    for k, v in out.items():
        assert torch.equal(v, HF[k]), (name, k)


def test_empty_blocks_and_index_normalisation(ck):
    spec = Cat([K("a"), K("b")], 0).bind(ck)
    assert spec.read((slice(3, 3),)).shape == (0, 3)
    assert normalize_index((slice(None, -1),), (4, 2)) == (slice(0, 3, 1), slice(0, 2, 1))
    assert normalize_index(slice(5, 2, 2), (4,)) == (slice(4, 4, 2),)
    assert spec.read((slice(None), slice(5, 2))).shape == (7, 0)


def test_spec_errors_name_the_problem(ck):
    with pytest.raises(TypeError, match="index entry 0 must be a slice, got 1"):
        K("a").bind(ck).read((1,))
    with pytest.raises(ValueError, match="step -1; steps must be ints >= 1"):
        K("a").bind(ck).read((slice(None, None, -1),))
    with pytest.raises(ValueError, match="3 entries but the tensor has 2 dims"):
        K("a").bind(ck).read((slice(None),) * 3)
    with pytest.raises(ValueError, match="agree except on dim 0"):
        Cat([K("a"), K("e0")], 0)
    with pytest.raises(ValueError, match="share one shape"):
        Stack([K("a"), K("b")])
    with pytest.raises(ValueError, match="n must be an int >= 1 dividing dim 0 of size 5"):
        Deinterleave(K("a"), 0, 2)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-2, 2\), got 2"):
        Transpose(K("a"), 0, 2)
    with pytest.raises(TypeError, match="parts must be a non-empty list"):
        Cat([], 0)
    with pytest.raises(ValueError, match="not bound to a checkpoint"):
        K("a").read()
    with pytest.raises(ValueError, match=r"has shape \(5, 3\), got a tensor of shape \(3, 5\)"):
        K("a").split(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="'e0' appears twice"):
        Stack([K("e0"), K("e0")]).split(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        Key("a", 5)


def test_checkpoint_reader_counts_bytes_and_reports_keys(ck, tmp_path):
    assert ck.keys() == sorted(HF) and "a" in ck and ck.shape("il") == (2, 3, 12)
    assert os.path.basename(ck.file_of("a")) == "model.safetensors"
    with pytest.raises(ValueError, match="has no tensor 'zz'"):
        ck.shape("zz")
