"""docs/training.md "Train on your data" runs end to end, offline, exactly as written (tiny preset):
the commands fmoe data, memory, train and plot."""

import json
import os
import pathlib
import re
import subprocess
import sys

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("## Train on your data")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_train_on_your_data_walkthrough(tmp_path):
    section = _section()
    script = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    (tmp_path / "make_corpus.py").write_text(script)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    r = subprocess.run([sys.executable, "make_corpus.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "2000 tokens", r.stderr[-2000:]
    assert "python -m" not in commands and commands.count("fmoe ") >= 5       # the console script, as written
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", commands],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "memory plan: qwen3_moe on 2 ranks" in r.stdout
    png = (tmp_path / "runs.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 20_000
    rows = [json.loads(line) for line in (tmp_path / "runs" / "mine" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [20, 40]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    meta = json.loads((tmp_path / "runs" / "mine" / "step-40" / "meta.json").read_text())
    assert meta["router"] == "sigmoid_topk:k=2" and meta["dtype"] == "bf16" and meta["config"]["vocab_size"] == 2048
    assert {"tokenizer.json", "config.json"} <= set(os.listdir(tmp_path / "runs" / "mine-hf"))
