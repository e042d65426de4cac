"""Tests of jmsnas.report: plot data helpers (hand-computed), summary text, PNG output and input validation."""
import copy
import os

import numpy as np
import pytest

from jmsnas import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _chain_result():
    ops = ["mbconv_k3_e3", "mbconv_k5_e6_res", "identity", "mbconv_k7_e3", "mbconv_k3_e6_res", "identity"]
    devs = ["ue", "ue", "sbs", "sbs", "cloud", "cloud"]
    return {"topology": "chain", "t_const_ms": 10.0,
            "architecture": [{"layer": i, "device": d, "op": o} for i, (d, o) in enumerate(zip(devs, ops))],
            "latency_ms": {"total": 9.1, "per_device": {"ue": 1.2, "sbs": 2.25, "cloud": 0.3},
                           "per_link": {"ue->sbs": 3.3, "sbs->cloud": 2.05}},
            "accuracy": {"val": 0.95, "test": 0.9412}, "params": 12345,
            "budget": {"met": True, "repaired": False, "min_reachable_ms": 7.0, "note": ""}}


def _mesh_result():
    devs = ["ue", "edge", "b1", "b1", "b2", "b2", "agg"]
    ops = ["mbconv_k3_e3", "mbconv_k3_e3", "mbconv_k5_e3", "identity", "mbconv_k7_e6", "identity", "mbconv_k3_e6"]
    return {"topology": "mesh", "t_const_ms": 6.0,
            "architecture": [{"layer": i, "device": d, "op": o} for i, (d, o) in enumerate(zip(devs, ops))],
            "latency_ms": {"total": 5.0,
                           "per_device": {"ue": 0.5, "edge": 1.0, "b1": 1.5, "b2": 0.75, "agg": 0.25},
                           "per_link": {"ue->edge": 1.0, "edge->b1": 0.5, "edge->b2": 0.5, "b1->agg": 0.25,
                                        "b2->agg": 0.5}},
            "accuracy": {"val": 0.9, "test": None}, "params": 999,
            "budget": {"met": True, "repaired": True, "min_reachable_ms": 3.5, "note": "argmax was 7.2 ms"}}


def _history(restart_epochs=False):
    rows = []
    for i, stage in enumerate(["warmup"] * 2 + ["search"] * 3 + ["retrain"] * 2):
        epoch = i if not restart_epochs else {"warmup": i, "search": i - 2, "retrain": i - 5}[stage]
        rows.append({"epoch": epoch, "stage": stage, "train_loss": 1.0 / (i + 1), "train_acc": 0.5 + 0.05 * i,
                     "val_acc": 0.4 + 0.05 * i, "expected_latency_ms": 12.0 - i if stage == "search" else None,
                     "derived_latency_ms": 11.0 - 0.5 * i})
    return rows


def _is_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return head == PNG_MAGIC and os.path.getsize(path) > 1000


# ------------------------------------------------------------------ plot data


def test_latency_segments_pipeline_order_chain():
    segs = report.latency_segments(_chain_result())
    assert segs == [("ue", "compute", 1.2), ("ue->sbs", "link", 3.3), ("sbs", "compute", 2.25),
                    ("sbs->cloud", "link", 2.05), ("cloud", "compute", 0.3)]


def test_latency_segments_mesh_lists_each_part_once():
    segs = report.latency_segments(_mesh_result())
    assert [n for n, _, _ in segs] == ["ue", "ue->edge", "edge", "edge->b1", "edge->b2", "b1", "b1->agg",
                                       "b2", "b2->agg", "agg"]
    assert sum(ms for _, _, ms in segs) == pytest.approx(6.75)  # > total 5.0: the branches overlap


def test_architecture_cells_decode_ops():
    cells = report.architecture_cells(_chain_result())
    assert [(c["layer"], c["row"], c["kernel"], c["expand"], c["residual"], c["label"]) for c in cells] == [
        (0, 0, 3, 3, False, "e3"), (1, 0, 5, 6, True, "e6"), (2, 1, 0, 0, False, "id"),
        (3, 1, 7, 3, False, "e3"), (4, 2, 3, 6, True, "e6"), (5, 2, 0, 0, False, "id")]


def test_history_series_global_and_restarting_epochs():
    s = report.history_series(_history())
    np.testing.assert_array_equal(s["x"], np.arange(7.0))
    assert s["stages"] == [("warmup", 0.0, 1.0), ("search", 2.0, 4.0), ("retrain", 5.0, 6.0)]
    assert np.isnan(s["expected"][[0, 1, 5, 6]]).all()
    np.testing.assert_allclose(s["expected"][2:5], [10.0, 9.0, 8.0])
    r = report.history_series(_history(restart_epochs=True))
    np.testing.assert_array_equal(r["x"], np.arange(1.0, 8.0))  # epochs restart per stage: running index
    assert not r["epoch_is_global"] and s["epoch_is_global"]


# ------------------------------------------------------------------ summary


def test_format_summary_chain_contents():
    text = report.format_summary(_chain_result())
    for name in ("ue", "sbs", "cloud", "ue->sbs", "sbs->cloud"):
        assert name in text
    for number in ("1.200", "3.300", "2.250", "2.050", "0.300", "9.100", "10.000", "95.00%", "94.12%", "12,345"):
        assert number in text
    assert "ue     (layers 0-1): mbconv_k3_e3, mbconv_k5_e6_res" in text
    assert "sum of the parts" in text and "9.100" in text
    assert "within the budget" in text and "met by the derived architecture" in text


def test_format_summary_mesh_repaired_and_missing_test_accuracy():
    text = report.format_summary(_mesh_result())
    assert "b2->agg" in text and "edge->b1" in text
    assert "6.750" in text and "5.000" in text  # sum of the parts vs the end-to-end total
    assert "parallel branches overlap" in text and "agg   (layer 6): mbconv_k3_e6" in text
    assert "repairing" in text and "argmax was 7.2 ms" in text
    assert "test n/a" in text and "Parameters: 999" in text


def test_format_summary_budget_not_met_and_exceeded():
    r = _chain_result()
    r["latency_ms"]["total"] = 12.5
    r["budget"] = {"met": False, "repaired": False, "min_reachable_ms": 11.25, "note": ""}
    text = report.format_summary(r)
    assert "EXCEEDS the budget" in text
    assert "NOT met" in text and "11.250 ms" in text


# ------------------------------------------------------------------ plots


def test_plot_latency_breakdown_bars(tmp_path):
    path = str(tmp_path / "b.png")
    fig = report.plot_latency_breakdown(_mesh_result(), path)
    assert _is_png(path)
    ax = fig.axes[0]
    assert len(ax.patches) == 10  # one stacked segment per device and per link
    assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(6.75)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "b2->agg (comm.)" in labels and "agg" in labels
    assert "end-to-end total\n(parallel branches overlap)" in labels


def test_plot_latency_breakdown_several_results(tmp_path):
    rs = [_chain_result(), _chain_result()]
    rs[1]["t_const_ms"] = 20.0
    path = str(tmp_path / "b.png")
    fig = report.plot_latency_breakdown(rs, path)
    assert _is_png(path)
    assert len(fig.axes[0].patches) == 10 and len(fig.axes) == 2  # 2 bars x 5 segments, accuracy axis
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["T_const 10 ms", "T_const 20 ms"]
    with pytest.raises(ValueError, match="labels has 1 entries"):
        report.plot_latency_breakdown(rs, path, labels=["x"])


def test_plot_architecture_cells(tmp_path):
    path = str(tmp_path / "a.png")
    fig = report.plot_architecture(_mesh_result(), path)
    assert _is_png(path)
    ax = fig.axes[0]
    assert len(ax.patches) == 7
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ue", "edge", "b1", "b2", "agg"]
    assert sum(1 for p in ax.patches if p.get_hatch()) == 0
    fig = report.plot_architecture(_chain_result(), path)
    assert sum(1 for p in fig.axes[0].patches if p.get_hatch()) == 2  # the two *_res ops


def test_plot_history_lines(tmp_path):
    path = str(tmp_path / "h.png")
    fig = report.plot_history(_history(), path, t_const_ms=9.0)
    assert _is_png(path)
    ax_acc, ax_lat = fig.axes
    assert len(ax_acc.get_lines()) == 2
    lat_lines = {ln.get_label(): ln for ln in ax_lat.get_lines()}
    assert "T_const = 9 ms" in lat_lines
    np.testing.assert_allclose(lat_lines["T of the derived architecture"].get_ydata(),
                               [11.0 - 0.5 * i for i in range(7)])


def test_plot_accuracy_latency_points(tmp_path):
    pts = [{"label": "T=5", "latency_ms": 4.8, "accuracy": 0.9, "group": "chain"},
           {"label": "T=10", "latency_ms": 9.1, "accuracy": 0.94, "group": "chain"},
           {"label": "T=5", "latency_ms": 4.1, "accuracy": 0.91, "group": "mesh"}]
    path = str(tmp_path / "s.png")
    fig = report.plot_accuracy_latency(pts, path, "acc vs latency", t_const_ms=10.0)
    assert _is_png(path)
    ax = fig.axes[0]
    offsets = np.concatenate([c.get_offsets() for c in ax.collections])
    assert offsets.shape == (3, 2)
    np.testing.assert_allclose(sorted(map(tuple, offsets)), [(4.1, 91.0), (4.8, 90.0), (9.1, 94.0)])
    assert [t.get_text() for t in ax.texts] == ["T=5", "T=10", "T=5"]
    with pytest.raises(ValueError, match=r"points\[0\].accuracy must be a fraction"):
        report.plot_accuracy_latency([dict(pts[0], accuracy=90.0)], path, "t")
    with pytest.raises(ValueError, match=r"missing key 'points\[0\].latency_ms'"):
        report.plot_accuracy_latency([{"label": "x", "accuracy": 0.5}], path, "t")


def test_write_report(tmp_path):
    workdir = tmp_path / "run"
    paths = report.write_report(_chain_result(), _history(), str(workdir))
    assert sorted(os.path.basename(p) for p in paths) == ["architecture.png", "history.png",
                                                          "latency_breakdown.png", "summary.txt"]
    for p in paths:
        assert os.path.isfile(p)
        if p.endswith(".png"):
            assert _is_png(p)
    with open(os.path.join(workdir, "summary.txt"), encoding="utf-8") as f:
        assert f.read() == report.format_summary(_chain_result())


# ------------------------------------------------------------------ validation


def _drop(result, dotted):
    r = copy.deepcopy(result)
    obj, keys = r, dotted.replace("]", "").replace("[", ".").split(".")
    for k in keys[:-1]:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    del obj[keys[-1]]
    return r


@pytest.mark.parametrize("key", ["topology", "t_const_ms", "architecture", "latency_ms", "latency_ms.total",
                                 "latency_ms.per_device", "latency_ms.per_link", "accuracy", "accuracy.val",
                                 "accuracy.test", "params", "architecture[2].op", "architecture[0].device",
                                 "budget.met"])
def test_missing_key_is_named(key, tmp_path):
    bad = _drop(_chain_result(), key)
    with pytest.raises(ValueError, match="missing key") as info:
        report.format_summary(bad)
    assert repr(key) in str(info.value)
    workdir = tmp_path / "w"
    with pytest.raises(ValueError):
        report.write_report(bad, _history(), str(workdir))
    assert not workdir.exists()  # nothing written for a bad result


@pytest.mark.parametrize("mutate,message", [
    (lambda r: r["accuracy"].update(val=95.0), "accuracy.val must be a fraction"),
    (lambda r: r["architecture"][1].update(op="conv9x9"), "unknown op 'conv9x9'"),
    (lambda r: r["architecture"][1].update(device="phone"), r"architecture\[1\].device 'phone'"),
    (lambda r: r["latency_ms"]["per_link"].update({"ue->mars": 1.0}), "per_link key 'ue->mars'"),
    (lambda r: r["latency_ms"]["per_device"].update(ue=-1.0), r"per_device\['ue'\] must be >= 0"),
    (lambda r: r["latency_ms"].update(total=float("nan")), "latency_ms.total must be a finite number"),
    (lambda r: r.update(architecture=[]), "architecture must be a non-empty list"),
])
def test_bad_values_are_named(mutate, message):
    r = _chain_result()
    mutate(r)
    with pytest.raises(ValueError, match=message):
        report.format_summary(r)


def test_bad_history_is_named(tmp_path):
    h = _history()
    h[3]["stage"] = "finetune"
    with pytest.raises(ValueError, match=r"history\[3\].stage must be one of"):
        report.plot_history(h, str(tmp_path / "h.png"))
    h = _history()
    del h[1]["derived_latency_ms"]
    with pytest.raises(ValueError, match=r"missing key 'history\[1\].derived_latency_ms'"):
        report.plot_history(h, str(tmp_path / "h.png"))
    assert not (tmp_path / "h.png").exists()


def test_memory_lines_and_panel_for_per_device_memory_only(tmp_path):
    """search/evolve's per-device memory is printed and plotted; SplitNets' sensor-peak entry is left alone."""
    r = _chain_result()
    r["memory"] = {d: {"bytes": 1000 * (i + 1), "weights": 600, "activations": 300, "buffers": 100 * (i + 1),
                       "limit_bytes": 4096 if d == "ue" else None, "within": True}
                   for i, d in enumerate(r["latency_ms"]["per_device"])}
    assert "Memory per device" in report.format_summary(r)
    report.plot_latency_breakdown(r, str(tmp_path / "a.png"))
    r["memory"] = {"sensor_peak_bytes": 123, "limit_bytes": 2 ** 21}
    assert "Memory per device" not in report.format_summary(r)
    report.plot_latency_breakdown(r, str(tmp_path / "b.png"))
