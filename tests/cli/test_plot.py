"""fmoe plot draws each run's logged curves, labelled by its meta.json."""

import json
import sys

import pytest

from fmoe.cli.plot import PANELS, plot_runs


def _fake_run(d, model, router, loss0, eval_every=2):
    d.mkdir()
    with open(d / "log.jsonl", "w") as f:
        for s in range(1, 7):
            row = {"step": s, "loss": loss0 / s, "tokens_per_s": 1000.0 + s, "load_imbalance": [1.0 + s, 3.0 + s]}
            if s % eval_every == 0:
                row["eval_loss"] = loss0 / s + 0.5
            f.write(json.dumps(row) + "\n")
    (d / "step-6").mkdir()
    (d / "step-6" / "meta.json").write_text(json.dumps({"model": model, "router": router,
                                                        "mesh": {"tp": 1, "ep": 4, "fsdp": 4, "dp_replicate": 1}}))
    return str(d)


def test_plot_writes_png_with_the_logged_curves(tmp_path):
    a = _fake_run(tmp_path / "a", "qwen3_moe", "sigmoid_topk:k=2", 6.0)
    b = _fake_run(tmp_path / "b", "mixtral", None, 3.0, eval_every=3)
    fig = plot_runs([a, b], str(tmp_path / "runs.png"))
    png = (tmp_path / "runs.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(panels) == {name for _, name in PANELS}
    loss = panels["training loss"].lines
    assert [ln.get_label() for ln in loss] == [f"{a}: qwen3_moe, router sigmoid_topk:k=2, tp=1 ep=4 fsdp=4 dp_replicate=1",
                                               f"{b}: mixtral, router default, tp=1 ep=4 fsdp=4 dp_replicate=1"]
    assert [ln.get_color() for ln in loss] == [ln.get_color() for ln in panels["held-out loss"].lines]
    assert list(loss[0].get_xdata()) == [1, 2, 3, 4, 5, 6] and loss[0].get_ydata()[2] == pytest.approx(2.0)
    ev = panels["held-out loss"].lines
    assert list(ev[0].get_xdata()) == [2, 4, 6] and list(ev[1].get_xdata()) == [3, 6]
    assert ev[1].get_ydata()[0] == pytest.approx(1.5)
    imb = panels["load imbalance (max/mean)"].lines[0]
    assert list(imb.get_ydata()) == pytest.approx([3.0, 4.0, 5.0, 6.0, 7.0, 8.0])     # mean over layers
    assert list(panels["tokens / s"].lines[1].get_ydata())[:2] == [1001.0, 1002.0]


def plot_cli(capsys, *args):
    """``fmoe plot *args`` in this process (the program's own ``main``: its parser, exit codes and
    one-line errors; ``tests/cli/test_commands.py`` starts the program as a process):
    ``(returncode, stderr)``."""
    from fmoe.cli.plot import main
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_plot_command_and_bad_run(tmp_path, capsys):
    a = _fake_run(tmp_path / "a", "qwen3_moe", None, 5.0)
    code, err = plot_cli(capsys, a, "--out", str(tmp_path / "x.png"))
    assert code == 0 and (tmp_path / "x.png").stat().st_size > 10_000, err
    code, err = plot_cli(capsys, str(tmp_path), "--out", str(tmp_path / "y.png"))
    assert code == 2 and "has no log.jsonl" in err


def test_plot_keeps_one_colour_per_run_and_never_overwrites_silently(tmp_path, monkeypatch, capsys):
    """A run without eval rows keeps its colour in every panel, the legend names every run
    directory, the default runs.png is never replaced silently, a missing --out directory is one
    line, and an image path that is a link is replaced, not written through."""
    from fmoe.cli.plot import main
    a = _fake_run(tmp_path / "a", "qwen3_moe", None, 5.0, eval_every=100)      # no eval rows at all
    b = _fake_run(tmp_path / "b", "mixtral", None, 3.0)
    fig = plot_runs([a, b], str(tmp_path / "r.png"))
    panels = {ax.get_title(): ax for ax in fig.axes}
    colors = [ln.get_color() for ln in panels["training loss"].lines]
    assert len(set(colors)) == 2 and [ln.get_color() for ln in panels["held-out loss"].lines] == colors[1:]
    assert [t.get_text().split(":")[0] for t in fig.legends[0].get_texts()] == [a, b]
    monkeypatch.chdir(tmp_path)
    assert main([a]) == 0 and (tmp_path / "runs.png").exists()
    before = (tmp_path / "runs.png").read_bytes()
    assert main([b]) == 2 and "runs.png exists; pass --out runs.png" in capsys.readouterr().err
    assert (tmp_path / "runs.png").read_bytes() == before
    assert main([a, "--out", str(tmp_path / "nope" / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"fmoe plot: error: --out {str(tmp_path / 'nope' / 'x.png')!r}: the directory " \
                      f"{str(tmp_path / 'nope')!r} does not exist"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "link.png").symlink_to(victim)
    assert main([a, "--out", "link.png"]) == 0
    assert victim.read_text() == "precious" and not (tmp_path / "link.png").is_symlink()
def test_metric_plot_log_smooth_per_layer_and_settings_labels(tmp_path, capsys):
    from fmoe.cli.plot_metric import plot_metric

    a = _fake_run(tmp_path / "a", "qwen3_moe", None, 6.0)
    meta = tmp_path / "a" / "step-6" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "balance": "bias", "bias_rate": 0.01,
                                "bias_update": "sign", "aux_weight": None}))
    fig = plot_metric([a], str(tmp_path / "m.png"), "load_imbalance", log=True, smoothing=2)
    (line,) = fig.axes[0].lines
    assert line.get_label().endswith(", balance bias u=0.01 sign")
    # layer means 3, 4, 5, ...; trailing 2-point mean: 3, 3.5, 4.5, ...
    assert list(line.get_ydata()) == pytest.approx([3.0, 3.5, 4.5, 5.5, 6.5, 7.5])
    assert fig.axes[0].get_yscale() == "log"
    fig = plot_metric([a], str(tmp_path / "l.png"), "load_imbalance", per_layer=True)
    assert [list(ln.get_ydata())[:2] for ln in fig.axes[0].lines] == [[2.0, 3.0], [4.0, 5.0]]
    code, err = plot_cli(capsys, a, "--metric", "maxvio", "--out", str(tmp_path / "x.png"))
    assert code == 2 and "no run logged 'maxvio'" in err
    code, err = plot_cli(capsys, a, "--metric", "load_imbalance", "--log", "--smooth", "3", "--out", str(tmp_path / "y.png"))
    assert code == 0 and (tmp_path / "y.png").stat().st_size > 10_000, err


def test_plot_without_matplotlib_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    from fmoe.cli.plot import main

    a = _fake_run(tmp_path / "a", "qwen3_moe", None, 5.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # as if it were not installed
    assert main([a, "--out", str(tmp_path / "x.png")]) == 1
    assert "pip install 'fmoe[plot]'" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_routing_panels_when_logged_legend_with_balance_and_missing_keys_skipped(tmp_path, capsys):
    """Drop rate and MaxVio (after and before dropping) get panels when a run logged them; a run
    without them has no line there and a note; --metric drop_rate skips it with a note."""
    from fmoe.cli.plot_metric import plot_metric

    top = _fake_run(tmp_path / "top", "qwen3_moe", "topk:k=2", 6.0)
    cap = _fake_run(tmp_path / "cap", "qwen3_moe", "switch:capacity_factor=1.0", 6.0)
    rows = [json.loads(line) for line in (tmp_path / "cap" / "log.jsonl").read_text().splitlines()]
    with open(tmp_path / "cap" / "log.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "drop_rate": [0.1 * r["step"], 0.3], "maxvio": [0.2, 0.4],
                                "maxvio_routed": [1.0, 2.0]}) + "\n")
    meta = tmp_path / "cap" / "step-6" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "balance": "aux", "aux_weight": 0.01}))
    fig = plot_runs([top, cap], str(tmp_path / "r.png"))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {n for _, n in PANELS} | {"drop rate (tokens no expert takes)", "MaxVio after dropping",
                                                    "MaxVio before dropping (routed)"}
    drop = panels["drop rate (tokens no expert takes)"].lines
    assert len(drop) == 1 and drop[0].get_ydata()[0] == pytest.approx(0.2)        # the layers' mean
    assert panels["MaxVio before dropping (routed)"].lines[0].get_ydata()[0] == pytest.approx(1.5)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[1].endswith("router switch:capacity_factor=1.0, tp=1 ep=4 fsdp=4 dp_replicate=1, balance aux w=0.01")
    assert f"{top} logged no 'drop_rate'" in capsys.readouterr().err
    fig = plot_metric([top, cap], str(tmp_path / "d.png"), "drop_rate")
    assert len(fig.axes[0].lines) == 1 and f"{top} logged no 'drop_rate'; skipped" in capsys.readouterr().err
    fig = plot_runs([top], str(tmp_path / "t.png"))                                # no routing keys: 4 panels
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 4


def test_plot_draws_per_rank_step_time_as_a_band_and_the_mean(tmp_path, capsys):
    """Rows with ``rank_step_time`` (one value per rank) get a panel: the band from the fastest to
    the slowest rank and the ranks' mean; a run without it has no line there, and a note says so."""
    import numpy as np

    from fmoe.cli.plot import PER_RANK

    a = _fake_run(tmp_path / "a", "qwen3_moe", None, 5.0)
    rows = [json.loads(line) for line in open(tmp_path / "a" / "log.jsonl")]
    with open(tmp_path / "a" / "log.jsonl", "w") as f:
        for r in rows:                                  # rank 1 is the slow one from step 4
            f.write(json.dumps({**r, "rank_step_time": [0.1 * r["step"], 0.1 * r["step"] + (1.0 if r["step"] >= 4
                                                                                           else 0.0)]}) + "\n")
    b = _fake_run(tmp_path / "b", "mixtral", None, 3.0)
    fig = plot_runs([a, b], str(tmp_path / "r.png"))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {name for _, name in PANELS + PER_RANK}
    ax = panels[PER_RANK[0][1]]
    (mean,) = ax.lines                                  # run b logged none
    assert mean.get_label().startswith(a) and mean.get_color() == panels["training loss"].lines[0].get_color()
    assert list(mean.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(mean.get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.9, 1.0, 1.1])
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert np.min(ys) == pytest.approx(0.1) and np.max(ys) == pytest.approx(1.6)     # fastest .. slowest rank
    assert f"{b} logged no 'rank_step_time'" in capsys.readouterr().err


def test_a_dead_layer_shows_as_the_band_of_worst_and_best_layer_and_the_legend_sits_beside(tmp_path):
    """Per-layer metrics: the band from the best to the worst layer and their mean (a layer at
    drop rate 1.0 beside one at 0.0 is not just 0.5); the legend is right of every panel."""
    import numpy as np

    run = _fake_run(tmp_path / "a", "qwen3_moe", "switch:capacity_factor=1.0", 4.0)
    rows = [json.loads(line) for line in open(tmp_path / "a" / "log.jsonl")]
    with open(tmp_path / "a" / "log.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "drop_rate": [1.0, 0.0]}) + "\n")
    fig = plot_runs([run], str(tmp_path / "r.png"))
    ax = {a.get_title(): a for a in fig.axes if a.get_visible()}["drop rate (tokens no expert takes)"]
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert np.min(ys) == pytest.approx(0.0) and np.max(ys) == pytest.approx(1.0)
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0.5] * len(rows))
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)                       # the closed figure, drawn again to measure it
    canvas.draw()
    renderer = canvas.get_renderer()
    right = max(a.get_window_extent(renderer).x1 for a in fig.axes if a.get_visible())
    assert fig.legends[0].get_window_extent(renderer).x0 >= right


def test_the_study_table_groups_seeds_into_arms_mean_and_sd(tmp_path, capsys):
    """``fmoe plot --table``: runs of the same settings are one arm (seeds), each cell the mean ±
    sd of the runs' last values; expert choice's held-out loss is marked as looking ahead."""
    import statistics

    from fmoe.cli.plot import main

    outs = []
    for name, router, loss0, drop in (("t0", "topk:k=2", 6.0, None), ("t1", "topk:k=2", 7.0, None),
                                      ("e0", "expert_choice", 6.0, [0.1, 0.3]), ("e1", "expert_choice", 6.5, [0.2, 0.2])):
        out = _fake_run(tmp_path / name, "qwen3_moe", router, loss0)
        rows = [json.loads(line) for line in open(tmp_path / name / "log.jsonl")]
        with open(tmp_path / name / "log.jsonl", "w") as f:
            for r in rows:
                extra = {"eval_maxvio": [0.5, 0.7]} if "eval_loss" in r else {}
                if drop and "eval_loss" in r:
                    extra.update(eval_drop_rate=drop, eval_uses_future_tokens=[1.0, 1.0])
                f.write(json.dumps({**r, **extra}) + "\n")
        outs.append(out)
    assert main([*outs, "--table"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| arm | runs | held-out loss | training loss | drop rate | MaxVio |"
    top, ec = table[2].rstrip(" |").split(" | "), table[3].rstrip(" |").split(" | ")
    held = [6.0 / 6 + 0.5, 7.0 / 6 + 0.5]
    assert top[1] == "2" and top[2] == f"{statistics.mean(held):.3f} ± {statistics.stdev(held):.3f}"
    assert top[4] == "—" and top[5] == "0.600 ± 0.000" and "router topk:k=2" in top[0]
    assert ec[0].endswith("*") and ec[4] == "0.200 ± 0.000" and "optimistic" in table[-1]
