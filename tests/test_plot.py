"""``jmsnas plot`` (jmsnas.runplot): on the six Fig. 5 runs of experiments/ it draws the points that
experiments/fig5.py draws; the Pareto marks and the stacked bars by hand; bad input is one line, exit 2."""
import importlib.util
import json
import os
import re

import ml_collections
import numpy as np
import pytest

from jmsnas import cli, report, runplot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = os.path.join(ROOT, "experiments", "results", "fig5_summary.md")


def _fig5():
    spec = importlib.util.spec_from_file_location("fig5_runner_plot", os.path.join(ROOT, "experiments", "fig5.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fig5_runs(tmp_path):
    """The six runs of experiments/results/fig5_summary.md as run directories (result.json + history.json with the
    numbers the summary reports: final T, test accuracy, stage-1 derived T and validation accuracy)."""
    rows = [ln for ln in open(SUMMARY, encoding="utf-8").read().splitlines() if re.match(r"\| (chain|mesh) \|", ln)]
    assert len(rows) == 6
    runs = []
    for ln in rows:
        c = [x.strip() for x in ln.strip("|").split("|")]
        topo, level = c[0], c[1].split()[0]
        t_const, s1_t, final_t = float(c[2]), float(c[5]), float(c[6])
        s1_acc, val, test = (float(x.rstrip("%")) / 100 for x in (c[8], c[9], c[10]))
        devices = ("ue", "sbs", "mbs", "cloud")
        per_device = {d: 0.1 for d in devices}
        per_link = {"ue->sbs": final_t - 0.6, "sbs->mbs": 0.1, "mbs->cloud": 0.1}
        result = {"topology": topo, "t_const_ms": t_const,
                  "latency_ms": {"total": final_t, "per_device": per_device, "per_link": per_link},
                  "accuracy": {"val": val, "test": test}, "params": int(c[11].replace(",", "")),
                  "architecture": [{"layer": i, "device": devices[i // 2], "op": "mbconv_k3_e3"} for i in range(8)],
                  "budget": {"met": True, "repaired": "repaired" in c[7]}, "dataset": "digits"}
        history = [{"epoch": 0, "stage": "warmup", "train_loss": 1.0, "train_acc": 0.5, "val_acc": 0.3,
                    "expected_latency_ms": 2.8, "derived_latency_ms": 2.9},
                   {"epoch": 1, "stage": "search", "train_loss": 0.5, "train_acc": 0.8, "val_acc": s1_acc,
                    "expected_latency_ms": 2.8, "derived_latency_ms": s1_t},
                   {"epoch": 2, "stage": "retrain", "train_loss": 0.2, "train_acc": 0.9, "val_acc": val,
                    "expected_latency_ms": None, "derived_latency_ms": final_t}]
        wd = tmp_path / "fig5" / f"{topo}_{level}"
        wd.mkdir(parents=True)
        (wd / "result.json").write_text(json.dumps(result))
        (wd / "history.json").write_text(json.dumps(history))
        cfg = ml_collections.ConfigDict({"experiment": {"topology": topo, "level": level, "fraction": 0.5,
                                                        "reachable_min_ms": 2.5, "reachable_max_ms": 3.0}})
        runs.append((cfg, str(wd)))
    return runs


def test_plot_reproduces_the_points_of_experiments_fig5(tmp_path, capsys):
    fig5 = _fig5()
    runs = _fig5_runs(tmp_path)
    rows = [fig5.load_row(cfg, wd) for cfg, wd in runs]
    ax = fig5.plot_fig5(rows, str(tmp_path / "fig5.png")).axes[0]
    # what fig5.py draws: per topology a dashed line through the filled points in latency order, and hollow points
    drawn_lines = [list(zip(*line.get_data())) for line in ax.lines]
    hollow = sorted(tuple(c.get_offsets()[0]) for c in ax.collections
                    if len(c.get_offsets()) and not len(c.get_facecolor()))
    assert cli.main(["plot", *[wd for _, wd in runs], "--out", str(tmp_path / "out"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in got["front"]] == ["chain", "mesh"]
    ours = [[(p["latency_ms"], 100 * p["test_accuracy"]) for p in g["points"]] for g in got["front"]]
    assert len(drawn_lines) == 2 and [np.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(ours, drawn_lines)] == [
        True, True]
    ours_hollow = sorted((p["stage1_latency_ms"], 100 * p["stage1_val_accuracy"]) for g in got["front"]
                         for p in g["points"])
    assert len(hollow) == 6 and np.allclose(ours_hollow, hollow, rtol=0, atol=1e-12)
    for name in ("front.png", "latency_bars.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    # the bars: one per run, its segments those of report.latency_segments, in pipeline order
    bars = got["bars"]
    assert [b["label"] for b in bars] == [os.path.basename(wd) for _, wd in runs]
    first = json.loads(open(os.path.join(runs[0][1], "result.json")).read())
    assert [(s["name"], s["kind"], s["ms"]) for s in bars[0]["segments"]] == report.latency_segments(first)
    assert [s["name"] for s in bars[0]["segments"]] == ["ue", "ue->sbs", "sbs", "sbs->mbs", "mbs", "mbs->cloud",
                                                        "cloud"]


def test_pareto_by_hand():
    pts = [(1.0, 0.9), (2.0, 0.95), (2.0, 0.93), (3.0, 0.95), (0.5, 0.5)]
    # (2, .93) loses to (2, .95); (3, .95) to (2, .95): equal accuracy at more latency
    assert runplot.pareto(pts) == [True, True, False, False, True]


@pytest.mark.parametrize("make, needle", [
    (lambda d: str(d / "nope"), "neither a result.json file nor a run directory"),
    (lambda d: (d / "x.json").write_text("{") and str(d / "x.json"), "cannot read"),
    (lambda d: (d / "x.json").write_text('{"flow": "separable"}') and str(d / "x.json"), "not the result.json"),
])
def test_bad_inputs_are_one_line_exit_2_nothing_written(tmp_path, capsys, make, needle):
    out = tmp_path / "out"
    assert cli.main(["plot", make(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jmsnas plot: error:") and needle in err and err.count("\n") == 1
    assert not out.exists()


def test_labels_must_match_the_runs_and_group_must_be_known(tmp_path, capsys):
    runs = _fig5_runs(tmp_path)
    assert cli.main(["plot", runs[0][1], "--labels", "a", "b", "--out", str(tmp_path / "o")]) == 2
    assert "--labels has 2 names for 1 runs" in capsys.readouterr().err
    assert cli.main(["plot", runs[0][1], "--group-by", "colour", "--out", str(tmp_path / "o")]) == 2
    assert "unknown group 'colour'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
