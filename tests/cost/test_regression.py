"""Fitted latency estimator U(.): recovery of a known law, held-out error on real tables, features, JSON."""
import json
from pathlib import Path

import numpy as np
import pytest

from jmsnas.cost import lut, regression as reg
from jmsnas.space import OPS, LayerSlot, op_flops, op_index, op_memory_bytes
import paths

REF = Path(paths.DATA) / "reference"  # vendored, see tests/data/README.md


def _random_features(rng, n):
    return [reg.LayerFeatures(macs=rng.uniform(1e5, 1e8), dw_macs=rng.uniform(0, 1e6), mem_bytes=rng.uniform(1e4, 1e7),
                              act_bytes=rng.uniform(1e4, 1e7), params=rng.uniform(0, 1e6), kernel=rng.choice([3, 5, 7]))
            for _ in range(n)]


def test_recovers_a_known_linear_law():
    rng = np.random.default_rng(0)
    feats = _random_features(rng, 120)
    terms = ("1", "macs", "dw_macs*kernel", "act_bytes")
    true = np.array([0.05, 2e-8, 3e-8, 4e-7])  # ms, ms/MAC, ms/(MAC*tap), ms/byte
    ms = reg.design(feats, terms) @ true
    model, report = reg.fit(feats, ms, holdout_fraction=0.25, seed=1, terms=terms)
    np.testing.assert_allclose(model.coef, true, rtol=1e-6)
    assert (report.n_train, report.n_holdout, len(report.holdout_index)) == (90, 30, 30)
    assert report.holdout_median_rel_error < 1e-6 and report.holdout_within_10pct == 1.0
    np.testing.assert_allclose(reg.predict(model, feats), ms, rtol=1e-6)


def test_noisy_law_error_is_reported_on_held_out_rows():
    rng = np.random.default_rng(1)
    feats = _random_features(rng, 200)
    clean = reg.design(feats, reg.DEFAULT_TERMS) @ np.array([0.1, 1e-8, 5e-8, 2e-7, 1e-7])
    noisy = clean * rng.uniform(0.8, 1.2, size=clean.shape)  # +-20% multiplicative noise
    model, report = reg.fit(feats, noisy, 0.3, seed=0)
    hold = np.array(report.holdout_index)
    err = np.abs(reg.predict(model, [feats[i] for i in hold]) - noisy[hold]) / noisy[hold]
    assert report.holdout_median_rel_error == pytest.approx(np.median(err))
    assert report.holdout_within_10pct == pytest.approx(np.mean(err <= 0.1))
    assert 0.02 < report.holdout_median_rel_error < 0.2  # the noise shows up, the law is still found


def test_proxyless_table_held_out_error():
    t = lut.load_lut(REF / "proxylessnas" / "mobile_trim.yaml")
    model, report = reg.fit_lut(t, holdout_fraction=0.25, seed=0)
    assert (report.n_train, report.n_holdout) == (54, 18)
    # measured: median 5.0%, 78% of held-out entries within +-10% (MACs alone: 31%, 22%)
    assert report.holdout_median_rel_error < 0.10 and report.holdout_within_10pct >= 0.6
    _, macs_only = reg.fit_lut(t, holdout_fraction=0.25, seed=0, terms=("1", "macs"))
    assert macs_only.holdout_median_rel_error > 2 * report.holdout_median_rel_error
    assert all(c >= 0 for c in model.coef)


def test_ofa_table_held_out_error():
    t = lut.load_lut(REF / "ofa_note10" / "224_lookup_table.yaml")
    _, report = reg.fit_lut(t, holdout_fraction=0.25, seed=0)
    assert report.holdout_median_rel_error < 0.08 and report.holdout_within_10pct >= 0.7  # measured 3.7%, 88%


def test_missing_keys_are_estimated_and_flagged():
    t = lut.load_lut(REF / "proxylessnas" / "mobile_trim.yaml")
    model, _ = reg.fit_lut(t, holdout_fraction=0.0)
    config = json.loads((REF / "proxylessnas" / "proxyless_mobile.config").read_text())
    res, estimated = reg.network_latency_with_model(t, lut.arch_layers(config), model)
    assert estimated == ("blocks.1", "blocks.2", "blocks.5")
    measured = {n: v for n, v in res.per_layer.items() if n not in estimated}
    assert all(measured[n] == t.entries[res.keys[n]] for n in measured)
    # the 32-channel block costs more than the table's 24-channel block of the same kind
    k24 = "expanded_conv-input:56x56x24-output:56x56x24-expand:3-kernel:3-stride:1-idskip:1"
    assert res.per_layer["blocks.2"] > t.entries[k24]
    assert res.total_ms == pytest.approx(sum(res.per_layer.values()))


def test_slot_and_key_features_agree_with_space():
    slot = LayerSlot(index=0, device=0, branch=-1, in_ch=24, out_ch=40, in_hw=56, out_hw=28, stride=2)
    op = OPS[op_index("mbconv_k5_e3")]
    f = reg.features_from_slot(op, slot)
    assert 2 * f.macs == op_flops(op, slot) and f.mem_bytes == op_memory_bytes(op, slot)
    key = lut.parse_key("expanded_conv-input:56x56x24-output:28x28x40-expand:3-kernel:5-stride:2-idskip:0")
    assert reg.features_from_key(key, "proxyless") == f
    # OFA writes the same block with 72 middle channels
    ofa = lut.parse_key("expanded_conv-input:56x56x24-output:28x28x40-expand:72-kernel:5-stride:2-idskip:0-se:0-hs:0")
    assert reg.features_from_key(ofa, "ofa") == f
    # hand count: expand 56*56*24*72, depthwise 28*28*72*25, project 28*28*72*40
    assert f.macs == 56 * 56 * 24 * 72 + 28 * 28 * 72 * 25 + 28 * 28 * 72 * 40
    assert f.dw_macs == 28 * 28 * 72 * 25
    ident = reg.features_from_slot(OPS[op_index("identity")], slot._replace(out_ch=24, out_hw=56, stride=1))
    assert ident.macs == ident.mem_bytes == ident.params == 0


def test_json_round_trip_and_errors():
    model = reg.LatencyModel(("1", "macs", "dw_macs*kernel"), (0.1, 2e-8, 3e-9))
    assert reg.model_from_json(reg.model_to_json(model)) == model
    with pytest.raises(ValueError, match="unknown feature 'flops'"):
        reg.model_from_json(json.dumps({"terms": ["flops"], "coef": [1.0]}))
    with pytest.raises(ValueError, match="2 terms"):
        reg.model_from_json(json.dumps({"terms": ["1", "macs"], "coef": [1.0]}))
    with pytest.raises(ValueError, match="not a latency model"):
        reg.model_from_json("[1, 2]")
    feats = _random_features(np.random.default_rng(0), 10)
    with pytest.raises(ValueError, match=r"rows \[3\] are \[-1.0\]"):
        reg.fit(feats, [1.0] * 3 + [-1.0] + [1.0] * 6)
    with pytest.raises(ValueError, match="10 feature rows but 9"):
        reg.fit(feats, [1.0] * 9)
    with pytest.raises(ValueError, match="holdout_fraction"):
        reg.fit(feats, [1.0] * 10, holdout_fraction=1.0)
    with pytest.raises(ValueError, match="cannot fit 5 terms"):
        reg.fit(feats[:5], [1.0] * 5, holdout_fraction=0.2)
