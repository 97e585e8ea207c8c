"""Generation with a cache, for all five models.

- Greedy ids of ``fmoe.generate`` equal transformers' ``generate(do_sample=False)`` token for
  token (20 new tokens, two prompts of different lengths, sliding windows that slide): the
  conformance suite's ``"generate"`` check, every family (``tests/distributed/test_conformance.py``).
- Cached decoding equals recomputing the whole (padded) sequence without a cache at every step
  (logits at rtol 1e-5), and a forward call leaves the cache it was given unchanged.
- Sampling is a pure function of the seed; ``top_p`` near 0 is greedy; ``eos_id`` ends rows.
- On 4 ranks (tp2/ep4 with all_to_all, and ep == tp = 2 where ``impl="auto"`` takes
  all_reduce, observed by a spy on the registered implementation) the ids equal one process.
"""

import pytest
import torch

import fmoe
from fmoe.model.generate import left_pad
from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe
from helpers import close, hf_model, on_ranks, program

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 13, 2, 7, 1, 3], [4, 8, 15]]
CASES = {
    "qwen3_moe": (qwen3_moe, qwen3_moe.Config.tiny(sliding_window=5), "Qwen3MoeForCausalLM"),
    "mixtral": (mixtral, mixtral.Config.tiny(sliding_window=5), "MixtralForCausalLM"),
    "gpt_oss": (gpt_oss, gpt_oss.Config.tiny(), "GptOssForCausalLM"),
    "llama": (llama, llama.Config.tiny(), "LlamaForCausalLM"),
    "deepseek_v3": (deepseek_v3, deepseek_v3.Config.tiny(), "DeepseekV3ForCausalLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_decoding_equals_full_recompute(case):
    model, cfg, _ = CASES[case]
    params = model.init(cfg, seed=1)
    params = fmoe.tree.map_with_path(lambda _, t: t * 8 if t.ndim > 1 else t, params)  # far from uniform
    tokens, positions = left_pad(PROMPTS)
    cache = model.init_cache(cfg, 2, 7 + 6)
    logits, cache = model.forward(params, tokens, cfg, cache=cache, positions=positions)
    close(logits, model.forward(params, tokens, cfg, positions=positions), f"{case} prefill")
    for t in range(6):
        ids = logits[:, -1].argmax(-1, keepdim=True)                         # [B, 1]
        new_pos = positions[:, -1:] + 1
        tokens, positions = torch.cat([tokens, ids], 1), torch.cat([positions, new_pos], 1)
        before = {k: v.clone() for k, v in fmoe.tree.flatten(cache).items()}
        logits, after = model.forward(params, ids, cfg, cache=cache, positions=new_pos)
        assert all(torch.equal(v, fmoe.tree.flatten(cache)[k]) for k, v in before.items()), "cache mutated"
        cache = after
        full = model.forward(params, tokens, cfg, positions=positions)       # no cache, whole sequence
        close(logits[:, -1], full[:, -1], f"{case} step {t}")
    assert int(cache["length"]) == 13 and bool(cache["mask"][1, 4:].all()) and not bool(cache["mask"][1, :4].any())


def test_sampling_is_a_function_of_the_seed_eos_and_bad_inputs():
    model, cfg, _ = CASES["qwen3_moe"]
    params = fmoe.tree.map_with_path(lambda _, t: t * 8 if t.ndim > 1 else t, model.init(cfg, seed=2))
    a = fmoe.generate(model, params, cfg, PROMPTS, 12, temperature=1.0, seed=3)
    assert torch.equal(a, fmoe.generate(model, params, cfg, PROMPTS, 12, temperature=1.0, seed=3))
    assert not torch.equal(a, fmoe.generate(model, params, cfg, PROMPTS, 12, temperature=1.0, seed=4))
    greedy = fmoe.generate(model, params, cfg, PROMPTS, 12)
    assert torch.equal(fmoe.generate(model, params, cfg, PROMPTS, 12, temperature=1.0, top_p=1e-6, seed=5), greedy)
    eos = int(greedy[0, 8])                                                  # row 0's second new token
    out = fmoe.generate(model, params, cfg, PROMPTS, 12, eos_id=eos)
    assert out[0, 8] == eos and bool((out[0, 8:] == eos).all())
    first_eos = (greedy[1, 7:] == eos).nonzero()
    n = int(first_eos[0]) if len(first_eos) else 12
    assert torch.equal(out[1, 7:7 + n], greedy[1, 7:7 + n])
    for kw, field in ((dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                      (dict(top_p=0.0), "top_p"), (dict(eos_id=cfg.vocab_size), "eos_id")):
        args = {"max_new_tokens": 2, **kw}
        with pytest.raises(ValueError, match=field):
            fmoe.generate(model, params, cfg, PROMPTS, args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError, match="no empty prompt"):
        fmoe.generate(model, params, cfg, [[1], []], 2)
    with pytest.raises(ValueError, match=r"prompt ids must lie in \[0, 128\)"):
        fmoe.generate(model, params, cfg, [[1, 128]], 2)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward(params, torch.zeros(2, 5, dtype=torch.long), cfg, cache=model.init_cache(cfg, 2, 4))


# ---- distributed -------------------------------------------------------------------------------------

DIST = ("qwen3_moe", "gpt_oss", "deepseek_v3")
MESHES = (dict(tp=2, ep=4), dict(tp=2, ep=2))


def _dist_params(case):
    model, cfg, _ = CASES[case]
    return model, cfg, fmoe.tree.map_with_path(lambda _, t: t * 8 if t.ndim > 1 else t, model.init(cfg, seed=1))


def _ranks(rank, world):
    calls = {"all_reduce": 0, "all_to_all": 0}
    for name in calls:
        impl = fmoe.ep.get(name)

        def spy(*a, _impl=impl, _name=name, **k):
            calls[_name] += 1
            return _impl(*a, **k)

        fmoe.ep.register(name, spy)
    out = {}
    for case in DIST:
        model, cfg, full = _dist_params(case)
        for kw in MESHES:
            mesh = fmoe.Mesh(**kw)
            before = dict(calls)
            ids = fmoe.generate(model, model.shard(full, cfg, mesh), cfg, PROMPTS, 8, mesh=mesh)
            cache = model.init_cache(cfg, 2, 4, mesh)
            placed = fmoe.placement_of(cache["layers"][0]["k" if "k" in cache["layers"][0] else "latent"])
            out[case, kw["ep"]] = (ids, {k: calls[k] - before[k] for k in calls}, placed)
    return out


def test_four_ranks_tp2_ep4_and_ep_equal_tp_give_one_process_ids():
    results = on_ranks(_ranks, 4, timeout=600)
    for case in DIST:
        model, cfg, full = _dist_params(case)
        want = fmoe.generate(model, full, cfg, PROMPTS, 8)
        for rank, res in enumerate(results):
            for ep in (4, 2):
                ids, calls, placed = res[case, ep]
                assert torch.equal(ids, want), (case, ep, rank)
                if ep == 2:    # ep == tp: decoding needs no gradient, so "auto" takes all_reduce
                    assert calls["all_reduce"] > 0 and calls["all_to_all"] == 0, (case, calls)
                else:
                    assert calls["all_to_all"] > 0 and calls["all_reduce"] == 0, (case, calls)
                want_p = fmoe.P() if case == "deepseek_v3" else fmoe.P(None, None, "tp")
                assert placed == want_p, (case, placed)


# ---- the command line ---------------------------------------------------------------------------------

def _tokenizer_json(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello experts", "mixture of experts"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return tok


def _generate_cli(capfd, *args):
    """``fmoe generate *args`` in this process; what it and its ranks (rank 0 prints, to the
    caller's file descriptors) wrote."""
    from fmoe.cli.generate import main
    return program(main, capfd, *args)


def test_command_line_prints_text_on_one_and_four_ranks(tmp_path, capfd):
    model, cfg, cls = CASES["qwen3_moe"]
    cfg = cfg.__class__.tiny(vocab_size=300, sliding_window=5)
    hf_model(cfg, cls).save_pretrained(tmp_path / "ck")
    tok = _tokenizer_json(tmp_path / "ck", 300)
    prompts = ["hello world", "the lazy fox jumps"]
    params, _ = model.load_hf(tmp_path / "ck")
    ids = fmoe.generate(model, params, cfg, [tok.encode(p).ids for p in prompts], 6)
    S = max(len(tok.encode(p).ids) for p in prompts)
    want = [tok.decode(tok.encode(p).ids + row[S:]) for p, row in zip(prompts, ids.tolist())]
    base = ["--ckpt", str(tmp_path / "ck"), "--max-new-tokens", "6", "--prompt", prompts[0], "--prompt", prompts[1]]
    for extra in ([], ["--nproc", "4", "--tp", "2", "--ep", "4"]):
        run = _generate_cli(capfd, *base, *extra)
        assert run.returncode == 0, run.stderr
        assert run.stdout == "".join(w + "\n" for w in want), (extra, run.stdout, want)
    bad = _generate_cli(capfd, *base[:4], "--prompt", "hello", "--top-p", "0")
    assert bad.returncode == 2 and "--top-p must be in (0, 1], got 0.0" in bad.stderr
    bad = _generate_cli(capfd, *base[:4], "--prompt", "hello", "--nproc", "4", "--tp", "2", "--ep", "3")
    assert bad.returncode == 2 and "--ep 3 must be a multiple of --tp 2" in bad.stderr, bad.stderr   # before any spawn
    bad = _generate_cli(capfd, *base[:2], "--ckpt", str(tmp_path), "--prompt", "1 2")
    assert bad.returncode == 1 and "neither config.json" in bad.stderr


def test_command_line_reads_a_training_checkpoint_as_bytes(tmp_path):
    from fmoe.cli.generate import main as generate_main
    from fmoe.cli.train import main as train_main

    assert train_main(["--model", "deepseek_v3", "--steps", "1", "--batch", "2", "--seq", "16", "--quiet",
                       "--out", str(tmp_path / "run"), "--export-hf", str(tmp_path / "hf")]) == 0
    outs = []
    for ck in (tmp_path / "run", tmp_path / "hf"):
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert generate_main(["--ckpt", str(ck), "--prompt", "def f(x):", "--bytes", "--max-new-tokens", "5",
                                  "--json"]) == 0
        outs.append(__import__("json").loads(buf.getvalue()))
    assert outs[0] == outs[1] and outs[0]["ids"][:9] == list(b"def f(x):") and len(outs[0]["ids"]) == 14
