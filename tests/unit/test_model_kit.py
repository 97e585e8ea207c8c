"""The public model kit's contracts a user model relies on (issue 42): a loaded and saved Hugging
Face checkpoint keeps the ``config.json`` fields the model does not use, and shared experts are
visible to the plan checks (``TP_FIELDS``) and to ``Model.widths`` (the memory plan counts them)."""

import dataclasses
import json
import logging

import pytest

from fmoe import model as kit
from fmoe.memory.plan import memory_plan
from fmoe.models import deepseek_v3, mixtral, qwen3_moe


def test_save_hf_passes_unused_config_fields_through(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = qwen3_moe.Config.tiny()
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg.to_hf(), bos_token_id=3, eos_token_id=4)).save_pretrained(tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    params, loaded = qwen3_moe.load_hf(tmp_path / "hf")
    assert loaded == cfg and dict(loaded.hf_extra)["bos_token_id"] == 3       # kept, not compared
    qwen3_moe.save_hf(params, loaded, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert {k: v for k, v in source.items() if k not in kit.NOT_PASSED} == {
        k: written.get(k) for k in source if k not in kit.NOT_PASSED}               # every field of the source
    assert "dtype" not in written and "transformers_version" not in written   # the file's, not the model's
    seen = logging.Handler()
    seen.records = []
    seen.emit = seen.records.append
    log = logging.getLogger("transformers")
    log.addHandler(seen)
    try:
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    finally:
        log.removeHandler(seen)
    assert [r.getMessage() for r in seen.records if r.levelno >= logging.WARNING] == []
    assert (again.config.bos_token_id, again.config.eos_token_id) == (3, 4)


def test_shared_experts_are_checked_and_counted():
    cfg = deepseek_v3.Config.tiny()
    assert deepseek_v3.MODEL.widths(cfg).Is == cfg.moe_intermediate_size * cfg.n_shared_experts
    assert mixtral.MODEL.widths(mixtral.Config.tiny()).Is == 0
    odd = dataclasses.replace(cfg, moe_intermediate_size=6, intermediate_size=96)     # Is = 6: tp=4 splits halves
    with pytest.raises(ValueError, match=r"tp=4 does not divide shared_expert_intermediate_size=6 "
                                         r"\(layers.1.moe.shared.w_down is split over tp"):
        deepseek_v3.MODEL.check_plan(odd, tp=4)
    user = dataclasses.replace(deepseek_v3.MODEL, tp_fields={**kit.TP_FIELDS, ("moe.shared.w_down", 1): "my_width"})
    with pytest.raises(ValueError, match="tp_fields name the config field 'my_width' for it, which Config does not"):
        user.check_plan(cfg, tp=2)
    two = dataclasses.replace(cfg, n_shared_experts=2)                # the memory plan counts the shared experts
    kw = dict(nproc=2, ep=2, batch=2, seq=16)
    a, b = memory_plan(deepseek_v3, cfg, **kw)["ranks"][0], memory_plan(deepseek_v3, two, **kw)["ranks"][0]
    assert b["activations_bytes"] > a["activations_bytes"] and b["params_bytes"] > a["params_bytes"]
