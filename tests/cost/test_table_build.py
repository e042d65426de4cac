"""build_table: every kind of latency source becomes one CostTable, checked against hand computations."""
import json
from pathlib import Path

import ml_collections
import numpy as np
import pytest
import yaml

from jmsnas.topology import presets
from jmsnas.cost import build as B
from jmsnas.cost import lut as L
from jmsnas.cost import profile as P
from jmsnas.cost import regression as RG
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import analytic_table, roofline_ms
from jmsnas.space import IDENTITY, OP_NAMES, OPS, build_space, op_flops, op_index, op_memory_bytes
import paths

REF = Path(paths.DATA) / "reference"  # vendored, see tests/data/README.md
MOBILE = REF / "proxylessnas" / "mobile_trim.yaml"


def _space():
    """UE -> SBS -> MBS -> cloud, one slot each: 4x4x8 -> 4x4x8, -> 2x2x12 (stride 2), -> 2x2x12, -> 2x2x16."""
    return build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                       device_channels=(8, 12, 12, 16), device_strides=(1, 2, 1, 1), stem_channels=8,
                       head_channels=16)


def _valid(space):
    m = space.mask()
    return [(s, i) for s in space.layers for i in np.flatnonzero(m[s.index]) if i != IDENTITY]


def _hand_measured(space, path, scale=1.0):
    """A measured-table file with known numbers: op i at slot n costs scale * (0.01 * (n + 1) + 0.001 * i)."""
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(scale * (0.01 * (s.index + 1) + 0.001 * i), 0.0, 5)
                           for i in np.flatnonzero(space.mask()[s.index]) if i != IDENTITY}} for s in space.layers)
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.04, 0, 5), 0.001,
                        P.Timing(0.02, 0, 5), P.Timing(0.03, 0, 5),
                        {"method": "in-network", "networks": 4, "offset_ms": -0.005})
    P.write_table(t, path)
    return t


def _lut_file(space, path, flavor="proxyless", drop=()):
    """A lookup table holding every key the space needs (mean = 0.1 * position), minus ``drop``."""
    keys = [k for _, k in B.lut_keys(space, flavor)]
    table = {k: {"count": 10, "mean": 0.1 * (j + 1), "var": 0.0} for j, k in enumerate(keys) if k not in drop}
    path.write_text(yaml.safe_dump(table))
    return {k: 0.1 * (j + 1) for j, k in enumerate(keys)}


# ------------------------------------------------------------------------------------------------ roofline


def test_default_is_the_analytic_roofline_table():
    space = _space()
    got, want = B.build_table(space), analytic_table(space)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_roofline_preset_row():
    space = _space()
    t = B.build_table(space, {"mbs": {"kind": "roofline", "preset": "eyeriss"}})
    eyeriss = presets.device("eyeriss")
    s, op = space.layers[2], OPS[op_index("mbconv_k5_e6_res")]  # 2x2x12 -> 2x2x12
    want = roofline_ms(op_flops(op, s), op_memory_bytes(op, s), eyeriss)
    assert float(t.compute_ms[2, 2, op_index("mbconv_k5_e6_res")]) == pytest.approx(want, rel=1e-6)
    assert float(t.compute_ms[2, 2, IDENTITY]) == 0.0


# ------------------------------------------------------------------------------------------------ measured


def test_measured_row_is_the_file(tmp_path):
    space = _space()
    _hand_measured(space, tmp_path / "ue.yaml")
    t = B.build_table(space, {"ue": {"kind": "measured", "path": str(tmp_path / "ue.yaml")}})
    for s, i in _valid(space):
        assert float(t.compute_ms[0, s.index, i]) == pytest.approx(0.01 * (s.index + 1) + 0.001 * i, rel=1e-6)
    assert float(t.stem_ms[0]) == pytest.approx(0.04 - 0.005 + 0.02, rel=1e-6)  # call + offset + stem
    assert float(t.head_ms[0]) == pytest.approx(0.03, rel=1e-6)


def test_measured_file_of_another_space_is_rejected(tmp_path):
    other = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                        device_channels=(8, 12, 12, 24), device_strides=(1, 2, 1, 1), stem_channels=8,
                        head_channels=16)
    _hand_measured(other, tmp_path / "o.yaml")
    with pytest.raises(P.ProfileError, match="another search space"):
        B.build_table(_space(), {"ue": {"kind": "measured", "path": str(tmp_path / "o.yaml")}})


# ---------------------------------------------------------------------------------------------- regression


def test_regression_model_row_by_hand(tmp_path):
    space = _space()
    (tmp_path / "m.json").write_text(RG.model_to_json(RG.LatencyModel(("1", "macs"), (0.01, 1e-6))))
    t = B.build_table(space, {"cloud": {"kind": "regression", "path": str(tmp_path / "m.json")}})
    for s, i in _valid(space):
        assert float(t.compute_ms[3, s.index, i]) == pytest.approx(0.01 + 1e-6 * op_flops(OPS[i], s) / 2, rel=1e-5)
    assert float(t.compute_ms[3, 0, IDENTITY]) == 0.0
    stem_macs = 4 * 4 * 9 * 1 * 8
    head_macs = 2 * 2 * 16 * 16 + 16 * 3  # 1x1 conv + classifier
    assert float(t.stem_ms[3]) == pytest.approx(0.01 + 1e-6 * stem_macs, rel=1e-5)
    assert float(t.head_ms[3]) == pytest.approx(0.02 + 1e-6 * head_macs, rel=1e-5)  # Conv_1 and Logits


def test_regression_fitted_on_a_measured_table_of_another_space_predicts_new_shapes(tmp_path):
    # the measured table follows a known linear law in the model's terms, so the fit recovers it and predicts
    # the slots of a different space exactly
    law = RG.LatencyModel(RG.DEFAULT_TERMS, (0.003, 2e-7, 5e-7, 1e-7, 3e-7))
    other = build_space(presets.chain_preset((2, 1, 1, 1)), image_size=8, in_channels=1, num_classes=3,
                        device_channels=(8, 16, 16, 24), device_strides=(1, 2, 1, 1), stem_channels=4,
                        head_channels=8)
    t = _hand_measured(other, tmp_path / "other.yaml")
    slots = tuple(dict(s, ops={name: P.Timing(float(RG.predict(law, [RG.features_from_slot(
        OPS[OP_NAMES.index(name)], other.layers[s["index"]])])[0]), 0.0, 5) for name in s["ops"]}) for s in t.slots)
    P.write_table(t._replace(slots=slots), tmp_path / "other.yaml")
    space = _space()
    tab = B.build_table(space, {"sbs": {"kind": "regression", "fit": str(tmp_path / "other.yaml")}})
    for s, i in _valid(space):
        want = RG.predict(law, [RG.features_from_slot(OPS[i], s)])[0]
        assert float(tab.compute_ms[1, s.index, i]) == pytest.approx(want, rel=1e-4)


# ---------------------------------------------------------------------------------------------- lookup table


def test_slot_keys_follow_the_proxyless_and_ofa_grammar():
    space = _space()
    s1 = space.layers[1]  # 4x4x8 -> 2x2x12, stride 2
    assert B.slot_key(s1, OPS[op_index("mbconv_k5_e6")]) == \
        "expanded_conv-input:4x4x8-output:2x2x12-expand:6-kernel:5-stride:2-idskip:0"
    assert B.slot_key(space.layers[2], OPS[op_index("mbconv_k3_e3_res")], "ofa") == \
        "expanded_conv-input:2x2x12-output:2x2x12-expand:36-kernel:3-stride:1-idskip:1-se:0-hs:0"
    names = dict(B.lut_keys(space, "proxyless"))
    assert names["stem"] == "Conv-input:4x4x1-output:4x4x8"
    assert names["head/Conv_1"] == "Conv_1-input:2x2x16-output:2x2x16"
    assert names["head/Logits"] == "Logits-input:2x2x16-output:3"
    ofa = dict(B.lut_keys(space, "ofa"))
    assert ofa["head/AvgPool2D"] == "AvgPool2D-input:2x2x16-output:1x1x16"
    assert ofa["head/Logits"] == "Logits-input:1x1x16-output:3"
    for _, k in B.lut_keys(space, "ofa"):
        assert L.format_key(L.parse_key(k)) == k


@pytest.mark.parametrize("flavor", ["proxyless", "ofa"])
def test_lut_row_reads_every_key(tmp_path, flavor):
    space = _space()
    values = _lut_file(space, tmp_path / "t.yaml", flavor)
    t = B.build_table(space, {"mbs": {"kind": "lut", "path": str(tmp_path / "t.yaml")}})
    for s, i in _valid(space):
        assert float(t.compute_ms[2, s.index, i]) == pytest.approx(values[B.slot_key(s, OPS[i], flavor)], rel=1e-6)
    keys = dict(B.lut_keys(space, flavor))
    assert float(t.stem_ms[2]) == pytest.approx(values[keys["stem"]], rel=1e-6)
    head = sum(values[k] for n, k in keys.items() if n.startswith("head/"))
    assert float(t.head_ms[2]) == pytest.approx(head, rel=1e-6)


def test_lut_missing_key_is_an_error_naming_it(tmp_path):
    space = _space()
    key = B.slot_key(space.layers[2], OPS[op_index("mbconv_k7_e6")])
    _lut_file(space, tmp_path / "t.yaml", drop=(key,))
    with pytest.raises(L.MissingKeysError, match=r"slots\[2\]/mbconv_k7_e6: " + key) as e:
        B.build_table(space, {"mbs": {"kind": "lut", "path": str(tmp_path / "t.yaml")}})
    assert e.value.keys == (key,)


def _proxyless_space():
    """Slots shaped like ProxylessNAS's mobile stages (224x224x3 input, 32-channel stem with stride 2)."""
    return build_space(presets.chain_preset((1, 2, 2, 1)), image_size=224, in_channels=3, num_classes=1000,
                       device_channels=(16, 24, 40, 80), device_strides=(1, 2, 2, 2), stem_channels=32,
                       stem_stride=2, head_channels=1280)


def test_real_mobile_table_lists_missing_keys_or_fills_them():
    space = _proxyless_space()
    with pytest.raises(L.MissingKeysError) as e:
        B.build_rows(space, {"ue": {"kind": "lut", "path": str(MOBILE)}})
    missing = dict(e.value.missing)
    # the table has 32->16 blocks only with expand 1, and same-shape blocks only with a shortcut
    assert missing["slots[0]/mbconv_k3_e3"] == \
        "expanded_conv-input:112x112x32-output:112x112x16-expand:3-kernel:3-stride:1-idskip:0"
    assert "slots[2]/mbconv_k5_e6" in missing and "slots[2]/mbconv_k5_e6_res" not in missing
    assert "stem" not in missing  # Conv-input:224x224x3-output:112x112x32 is in the table
    rows = B.build_rows(space, {"ue": {"kind": "lut", "path": str(MOBILE), "fill": "regression"}})
    row, table = rows["ue"], L.load_lut(MOBILE)
    assert set(row.estimated) == set(missing)
    s = space.layers[1]  # 112x112x16 -> 56x56x24: every op is in the table
    for i in (op_index("mbconv_k3_e3"), op_index("mbconv_k7_e6")):
        assert row.compute_ms[1, i] == table.entries[B.slot_key(s, OPS[i])]
    assert row.stem_ms == table.entries["Conv-input:224x224x3-output:112x112x32"]
    assert np.all(row.compute_ms[space.mask() & (np.arange(len(OPS)) != IDENTITY)] > 0)


# ------------------------------------------------------------------------------------------------ scaled


def test_scaled_row_and_chains_rejected(tmp_path):
    space = _space()
    base = B.build_table(space)
    t = B.build_table(space, {"cloud": {"kind": "scaled", "of": "sbs", "factor": 0.5}})
    np.testing.assert_allclose(np.asarray(t.compute_ms[3]), 0.5 * np.asarray(base.compute_ms[1]), rtol=1e-6)
    with pytest.raises(B.TableSpecError, match="'of' device 'mbs' is itself scaled"):
        B.build_table(space, {"cloud": {"kind": "scaled", "of": "mbs", "factor": 2},
                              "mbs": {"kind": "scaled", "of": "ue", "factor": 2}})


# ------------------------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize("spec, fragment", [
    ({"phone": {"kind": "roofline"}}, r"unknown device\(s\) \['phone'\]"),
    ({"ue": {"kind": "magic"}}, "device 'ue': unknown kind 'magic'"),
    ({"ue": "roofline"}, "device 'ue': expected a mapping with a 'kind'"),
    ({"sbs": {"kind": "measured"}}, r"device 'sbs' \(kind 'measured'\): missing field\(s\) \['path'\]"),
    ({"sbs": {"kind": "lut", "path": "x.yaml", "mean": 1}}, r"unknown field\(s\) \['mean'\]"),
    ({"sbs": {"kind": "lut", "path": "x.yaml", "fill": "zero"}}, "fill must be 'error' or 'regression'"),
    ({"mbs": {"kind": "scaled", "of": "ue", "factor": -1}}, "device 'mbs': factor must be a positive number"),
    ({"mbs": {"kind": "scaled", "of": "edge", "factor": 2}}, "'of' names unknown device 'edge'"),
    ({"cloud": {"kind": "regression", "path": "a.json", "fit": "b.yaml"}}, "exactly one of 'path'"),
    ({"cloud": {"kind": "roofline", "preset": "abacus"}}, "unknown device preset 'abacus'"),
    ({"cloud": {"kind": "measured", "path": 3}}, "path must be a file path"),
    (["ue"], "must be a mapping of device name"),
])
def test_bad_spec_entries_are_named(spec, fragment):
    with pytest.raises(B.TableSpecError, match=fragment):
        B.build_table(_space(), spec)


def test_bad_activation_bits_and_unreadable_files(tmp_path):
    with pytest.raises(B.TableSpecError, match="activation bits"):
        B.build_table(_space(), None, activation_bits=12)
    with pytest.raises(B.TableSpecError, match="cannot read regression model"):
        B.build_table(_space(), {"ue": {"kind": "regression", "path": str(tmp_path / "none.json")}})
    with pytest.raises(L.LUTError, match="cannot read latency table"):
        B.build_table(_space(), {"ue": {"kind": "lut", "path": str(tmp_path / "none.yaml")}})


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_mix_measured_here_roofline_lut_regression_into_arch_latency(tmp_path):
    """UE measured on this backend, SBS roofline, MBS imported lookup table, cloud regression; arch_latency
    equals the hand sum of each device's own layers, the UE's stem, the cloud's head and the transfers."""
    space = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                        device_channels=(8, 8, 8, 8), device_strides=(1, 1, 1, 1), stem_channels=8,
                        head_channels=16)  # one slot shape: the profile times 12 networks
    ue = P.measure_table(space, reps=3, warmup=0)
    P.write_table(ue, tmp_path / "ue.yaml")
    lut_values = _lut_file(space, tmp_path / "mbs.yaml")
    (tmp_path / "cloud.json").write_text(RG.model_to_json(RG.LatencyModel(("1", "macs"), (0.002, 3e-8))))
    spec = ml_collections.ConfigDict({"ue": {"kind": "measured", "path": str(tmp_path / "ue.yaml")},
                                      "mbs": {"kind": "lut", "path": str(tmp_path / "mbs.yaml")},
                                      "cloud": {"kind": "regression", "path": str(tmp_path / "cloud.json")}})
    table = B.build_table(space, spec, activation_bits=8)
    ops = [op_index("mbconv_k5_e3_res"), op_index("mbconv_k3_e6"), op_index("mbconv_k7_e6_res"),
           op_index("mbconv_k3_e3")]
    ue_ms = (P.load_table(tmp_path / "ue.yaml").slots[0]["ops"]["mbconv_k5_e3_res"].median_ms
             + ue.call.median_ms + ue.stem.median_ms + ue.network["offset_ms"])
    s1, s3 = space.layers[1], space.layers[3]
    sbs_ms = roofline_ms(op_flops(OPS[ops[1]], s1), op_memory_bytes(OPS[ops[1]], s1), space.topology.devices[1])
    mbs_ms = lut_values[B.slot_key(space.layers[2], OPS[ops[2]])]
    cloud_ms = 0.002 + 3e-8 * op_flops(OPS[ops[3]], s3) / 2 + (0.002 + 3e-8 * 4 * 4 * 8 * 16) + (0.002 + 3e-8 * 48)
    # 8-bit activations: each device sends its one layer's output; Table I links 25, 50, 200 Mbit/s
    comm = sum(s.out_elems * 8 / (bw * 1e3) for s, bw in zip(space.layers[:3], (25.0, 50.0, 200.0)))
    got = arch_latency(space, table, np.array(ops))
    # arch_latency sums in float32; the measured network offset may be negative and cancel most of the UE's other
    # terms when the machine is loaded, so the tolerance is relative to the terms' magnitudes, not to their sum
    ue_terms = (P.load_table(tmp_path / "ue.yaml").slots[0]["ops"]["mbconv_k5_e3_res"].median_ms, ue.call.median_ms,
                ue.stem.median_ms, ue.network["offset_ms"])
    scale = sum(abs(v) for v in ue_terms) + sbs_ms + mbs_ms + cloud_ms + comm
    np.testing.assert_allclose(np.asarray(got.per_device), [ue_ms, sbs_ms, mbs_ms, cloud_ms], rtol=1e-5,
                               atol=1e-6 * scale)
    assert float(got.total) == pytest.approx(ue_ms + sbs_ms + mbs_ms + cloud_ms + comm, rel=1e-5, abs=1e-6 * scale)
