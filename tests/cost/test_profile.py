"""Profiling harness: measured table files, their validation, the latency model, ``jmsnas profile``.

Timings are never asserted (they depend on the machine and its load); the tests check the file, the validation,
the shape cache and that prediction is exactly the documented sum.
"""
import copy
import json
import math

import numpy as np
import pytest
import yaml

from jmsnas import cli
from jmsnas.topology import presets
from jmsnas.cost import profile as P
from jmsnas.cost.build import build_table
from jmsnas.cost.latency import arch_latency
from jmsnas.space import IDENTITY, OP_NAMES, build_space, op_index
from jmsnas.topology import make_topology


def _one_device_space(channels=8, image=4):
    """One device, 4 slots of one shape (4x4x8 -> 4x4x8, stride 1): every op is measured once, used 4 times."""
    topo = make_topology("chain", [presets.device("raspberry_pi4", "ue")], [], (4,))
    return build_space(topo, image_size=image, in_channels=1, num_classes=3, device_channels=(channels,),
                       device_strides=(1,), stem_channels=channels, stem_stride=1, head_channels=16)


SPACE_FILE = {"topology": "chain", "layers_per_device": [1, 1, 1, 1], "image_size": 4, "in_channels": 1,
              "num_classes": 3, "device_channels": [8, 8, 8, 8], "device_strides": [1, 1, 1, 1],
              "stem_channels": 8, "head_channels": 16}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A real profile of a small 4-device chain space through the CLI (few rounds): (space, path)."""
    d = tmp_path_factory.mktemp("profile")
    (d / "space.json").write_text(json.dumps(SPACE_FILE))
    out = d / "table.yaml"
    rc = cli.main(["profile", "--space", str(d / "space.json"), "--out", str(out), "--reps", "3", "--warmup", "0"])
    assert rc == 0
    space = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                        device_channels=(8, 8, 8, 8), device_strides=(1, 1, 1, 1), stem_channels=8,
                        head_channels=16)
    return space, out


def test_profile_file_is_complete_and_loads(profiled):
    space, path = profiled
    t = P.load_table(path, space)
    assert t.fingerprint == P.space_fingerprint(space)
    assert t.device["backend"] in ("cpu", "gpu", "tpu", "cuda", "rocm")
    # in-network: 8 copies of the base network, its 12 one-slot variants (11 MBConvs, identity; one shape) and
    # 8 random calibration networks
    assert t.settings["reps"] == 3 and t.settings["method"] == "in-network"
    assert t.network == {"method": "in-network", "networks": 28, "offset_ms": t.network["offset_ms"]}
    mask = space.mask()
    for s in space.layers:
        want = {OP_NAMES[i] for i in np.flatnonzero(mask[s.index]) if i != IDENTITY}
        assert set(t.slots[s.index]["ops"]) == want
        assert t.slots[s.index]["shape"] == {"in_hw": 4, "in_ch": 8, "out_hw": 4, "out_ch": 8, "stride": 1}
        for timing in t.slots[s.index]["ops"].values():
            assert timing.reps == 3 and timing.median_ms >= 0 and timing.spread_ms >= 0
    assert t.fixed_ms >= 0 and t.arg_ms >= 0


def test_identical_slot_shapes_are_measured_once(profiled):
    # every slot has the same shape, so all four slots hold the very same measurement (timings of separate
    # measurements would differ in their last digits)
    _, path = profiled
    t = P.load_table(path)
    assert all(s["ops"] == t.slots[0]["ops"] for s in t.slots[1:])


def test_file_is_human_readable_yaml_with_documented_fields(profiled):
    _, path = profiled
    text = path.read_text()
    assert text.startswith("# jmsnas latency table (ms)")
    d = yaml.safe_load(text)
    assert d["format"] == "jmsnas-latency-table" and d["units"] == "ms"
    assert set(d) >= {"device", "settings", "space", "call", "arg_ms", "network", "stem", "head", "slots"}
    assert set(d["slots"][0]["ops"]["mbconv_k3_e3"]) == {"median_ms", "spread_ms", "reps"}


def test_write_load_roundtrip(profiled, tmp_path):
    _, path = profiled
    t = P.load_table(path)
    P.write_table(t, tmp_path / "again.yaml")
    assert P.load_table(tmp_path / "again.yaml") == t


# ------------------------------------------------------------------------------------------ prediction


def _hand_table(space, seed=0):
    """A MeasuredTable with known numbers for ``space`` (no timing involved)."""
    rng = np.random.default_rng(seed)
    mask = space.mask()
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(float(rng.uniform(0.01, 0.1)), 0.001, 5)
                           for i in np.flatnonzero(mask[s.index]) if i != IDENTITY}} for s in space.layers)
    return P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.05, 0.01, 5),
                           0.001, P.Timing(0.02, 0.0, 5), P.Timing(0.03, 0.0, 5),
                           {"method": "standalone", "networks": 3, "offset_ms": -0.01})


def test_predict_is_fixed_terms_plus_op_entries():
    space = _one_device_space()
    t = _hand_table(space)
    ops = [op_index("mbconv_k5_e6"), IDENTITY, op_index("mbconv_k3_e3_res"), op_index("mbconv_k7_e3")]
    want = 0.05 - 0.01 + 0.02 + 0.03 + sum(t.slots[n]["ops"][OP_NAMES[i]].median_ms
                                           for n, i in enumerate(ops) if i != IDENTITY)
    assert P.predict_arch_ms(t, ops) == pytest.approx(want, rel=1e-12)


def test_cost_table_of_a_measured_file_gives_the_same_prediction(tmp_path):
    # one device: arch_latency of the CostTable built from the file is exactly the table's own prediction
    space = _one_device_space()
    t = _hand_table(space, seed=3)
    P.write_table(t, tmp_path / "t.yaml")
    table = build_table(space, {"ue": {"kind": "measured", "path": str(tmp_path / "t.yaml")}})
    for ops in P.sample_archs(space, 5, 0):
        assert float(arch_latency(space, table, np.array(ops)).total) == pytest.approx(P.predict_arch_ms(t, ops),
                                                                                        rel=1e-5)


def test_sample_archs_are_valid_and_seeded():
    space = _one_device_space()
    a = P.sample_archs(space, 20, 7)
    assert a == P.sample_archs(space, 20, 7) and a != P.sample_archs(space, 20, 8)
    for ops in a:
        space.validate_arch(ops)


def test_measure_arch_ms_runs_and_rejects_invalid_archs():
    space = _one_device_space()
    ops = P.sample_archs(space, 1, 0)[0]
    t = P.measure_arch_ms(space, ops, reps=3, warmup=0)
    assert t.reps == 3 and t.median_ms > 0 and math.isfinite(t.spread_ms)
    with pytest.raises(ValueError, match="layer 0"):
        P.measure_arch_ms(space, [99, 0, 0, 0], reps=3)


@pytest.mark.parametrize("kwargs, fragment", [({"reps": 1}, "reps must be an integer >= 3"),
                                              ({"batch": 0}, "batch must be"),
                                              ({"quantile": 1.0}, "quantile must be"),
                                              ({"calibrate": -1}, "calibrate must be")])
def test_bad_settings_are_rejected_before_measuring(kwargs, fragment):
    with pytest.raises(P.ProfileError, match=fragment):
        P.measure_table(_one_device_space(), **kwargs)


# ------------------------------------------------------------------------------------------ validation


@pytest.fixture
def good(tmp_path):
    space = _one_device_space()
    P.write_table(_hand_table(space), tmp_path / "good.yaml")
    return space, yaml.safe_load((tmp_path / "good.yaml").read_text())


def _load(tmp_path, d, space=None):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    return P.load_table(p, space)


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["slots"][1]["ops"]["mbconv_k5_e3"].pop("median_ms"),
     r"slots\[1\]\.ops\.mbconv_k5_e3: missing field 'median_ms'"),
    (lambda d: d["slots"][2]["ops"]["mbconv_k7_e6"].__setitem__("median_ms", -0.5),
     r"slots\[2\]\.ops\.mbconv_k7_e6\.median_ms: -0\.5 is not a finite number >= 0"),
    (lambda d: d["slots"][0]["ops"]["mbconv_k3_e3"].__setitem__("median_ms", float("nan")),
     r"slots\[0\]\.ops\.mbconv_k3_e3\.median_ms: nan"),
    (lambda d: d["slots"][0]["ops"]["mbconv_k3_e3"].__setitem__("spread_ms", float("inf")),
     r"slots\[0\]\.ops\.mbconv_k3_e3\.spread_ms: inf"),
    (lambda d: d["slots"][3]["ops"]["mbconv_k3_e3"].__setitem__("reps", 2.5), r"slots\[3\]\.ops\.mbconv_k3_e3\.reps"),
    (lambda d: d["slots"][0]["ops"].__setitem__("mbconv_k9_e3", {"median_ms": 1, "spread_ms": 0, "reps": 1}),
     r"slots\[0\]\.ops\.mbconv_k9_e3: unknown op"),
    (lambda d: d["head"].__setitem__("median_ms", "fast"), r"head\.median_ms: 'fast'"),
    (lambda d: d.pop("call"), r"call: missing field 'call'"),
    (lambda d: d["slots"][0]["shape"].pop("stride"), r"slots\[0\]\.shape: missing field 'stride'"),
    (lambda d: d["slots"][1].__setitem__("index", 5), r"slots\[1\]\.index: 5, expected 1"),
    (lambda d: d.__setitem__("format", "proxyless"), "format/version 'proxyless'/1"),
    (lambda d: d["network"].__setitem__("offset_ms", -5.0), "network.offset_ms: -5.0 makes"),
    (lambda d: d["network"].__setitem__("method", "guess"), "network.method: 'guess'"),
])
def test_loader_rejects_malformed_entries_naming_them(good, tmp_path, edit, fragment):
    _, d = good
    d = copy.deepcopy(d)
    edit(d)
    with pytest.raises(P.ProfileError, match=fragment):
        _load(tmp_path, d)


def test_loader_rejects_a_table_of_another_space(good, tmp_path):
    _, d = good
    with pytest.raises(P.ProfileError, match="another search space.*differs in: stem_channels"):
        _load(tmp_path, d, _one_device_space(channels=12))


def test_loader_rejects_a_table_lacking_a_valid_op(good, tmp_path):
    space, d = good
    del d["slots"][2]["ops"]["mbconv_k5_e6_res"]
    with pytest.raises(P.ProfileError, match=r"slots\[2\]\.ops lacks valid op 'mbconv_k5_e6_res'"):
        _load(tmp_path, d, space)


def test_loader_errors_for_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(P.ProfileError, match="cannot read latency table"):
        P.load_table(tmp_path / "nope.yaml")
    (tmp_path / "x.yaml").write_text("a: [1, 2\n")
    with pytest.raises(P.ProfileError, match="not valid YAML"):
        P.load_table(tmp_path / "x.yaml")


def test_fingerprint_depends_on_shapes_only():
    a, b = _one_device_space(), _one_device_space()
    assert P.space_fingerprint(a) == P.space_fingerprint(b)
    assert P.space_fingerprint(a) != P.space_fingerprint(_one_device_space(image=6))


# ------------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("argv, fragment", [
    (["--space", "no_such_space.json"], "neither 'default', 'mesh' nor an existing file"),
    (["--space", "default", "--reps", "0"], "reps must be an integer >= 3"),
    (["--space", "default", "--quantile", "2"], "quantile must be"),
])
def test_cli_errors_are_one_line_and_exit_2(argv, fragment, tmp_path, capsys):
    out = tmp_path / "t.yaml"
    assert cli.main(["profile", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jmsnas profile: error:") and fragment in err and "\n" not in err
    assert not out.exists()


def test_cli_bad_space_file_and_unwritable_out(tmp_path, capsys):
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({**SPACE_FILE, "widths": [1]}))
    assert cli.main(["profile", "--space", str(bad), "--out", str(tmp_path / "t.yaml")]) == 2
    assert "unknown field(s) ['widths']" in capsys.readouterr().err
    good = tmp_path / "g.json"
    good.write_text(json.dumps(SPACE_FILE))
    assert cli.main(["profile", "--space", str(good), "--out", str(tmp_path / "no" / "t.yaml")]) == 2
    assert "does not exist or is not writable" in capsys.readouterr().err


def test_cli_default_space_is_the_main_jobs():
    from jmsnas.commands.profile import space_from_arg
    s = space_from_arg("default")
    want = build_space(presets.chain_preset(), image_size=8, in_channels=1, num_classes=10,
                       device_channels=(24, 32, 48, 64), device_strides=(1, 2, 1, 2), stem_channels=16,
                       stem_stride=1, head_channels=128)
    assert P.space_fingerprint(s) == P.space_fingerprint(want)


def test_calibrated_scale_recovers_a_network_wide_factor():
    """Whole networks that cost 0.7 x the sum of their op entries + 0.05 ms: the fitted table predicts them
    exactly, whatever one outlier (a burst of load) says."""
    space = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                        device_channels=(8, 8, 8, 8), device_strides=(1, 1, 1, 1), stem_channels=8, head_channels=16)
    rng = np.random.default_rng(0)
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(float(rng.uniform(0.01, 0.05)), 0.001, 5)
                           for i in np.flatnonzero(space.mask()[s.index]) if i != IDENTITY}} for s in space.layers)
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.02, 0, 5), 0.0,
                        P.Timing(0.01, 0, 5), P.Timing(0.01, 0, 5), {"method": "in-network", "networks": 20,
                                                                       "offset_ms": 0.3})
    archs = P.sample_archs(space, 9, 1)
    truth = lambda tab, a: 0.04 + 0.05 + 0.7 * (P.predict_arch_ms(tab, a) - tab.fixed_ms)
    measured = [truth(t, a) for a in archs]
    measured[3] += 1.0  # an outlier
    fitted = P._calibrated_scale(t, archs, measured)
    assert fitted.network["networks"] == 29 and fitted.network["offset_ms"] == pytest.approx(0.05)
    for a in P.sample_archs(space, 20, 2):
        assert P.predict_arch_ms(fitted, a) == pytest.approx(truth(t, a), rel=1e-9)


def test_calibrated_scale_without_spread_keeps_the_entries_and_counts_the_networks():
    """Every op entry clamped to 0 (a tiny space timed under load): no slope can be fitted, the entries and the
    offset stay as they were, and the calibration networks still count as measured."""
    space = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                        device_channels=(8, 8, 8, 8), device_strides=(1, 1, 1, 1), stem_channels=8, head_channels=16)
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(0.0, 0.0, 5)
                           for i in np.flatnonzero(space.mask()[s.index]) if i != IDENTITY}} for s in space.layers)
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.02, 0, 5), 0.0,
                        P.Timing(0.01, 0, 5), P.Timing(0.01, 0, 5), {"method": "in-network", "networks": 20,
                                                                       "offset_ms": 0.3})
    archs = P.sample_archs(space, 8, 1)
    fitted = P._calibrated_scale(t, archs, [0.5 + 0.01 * k for k in range(8)])
    assert fitted.network == {"method": "in-network", "networks": 28, "offset_ms": 0.3}
    assert fitted.slots == t.slots
