"""Lookup-table import (ProxylessNAS / OFA) and the ``jmsnas latency`` command."""
import copy
import itertools
import json
import math
from pathlib import Path

import pytest

from jmsnas import cli
from jmsnas.cost import lut
import paths

REF = Path(paths.DATA) / "reference"  # vendored, see tests/data/README.md
PROXYLESS = REF / "proxylessnas"
OFA = REF / "ofa_note10"


def _config(name):
    return json.loads((PROXYLESS / f"proxyless_{name}.config").read_text())


# ------------------------------------------------------------------------------------------- key grammar


def test_parse_key_proxyless_and_ofa():
    k = lut.parse_key("expanded_conv-input:112x112x16-output:56x56x24-expand:3-kernel:5-stride:2-idskip:0")
    assert k == lut.LayerKey("expanded_conv", (112, 112, 16), (56, 56, 24), 3, 5, 2, 0, None, None)
    k = lut.parse_key("expanded_conv-input:56x56x32-output:28x28x48-expand:128-kernel:3-stride:2-idskip:0-se:1-hs:0")
    assert (k.expand, k.se, k.hs) == (128, 1, 0)
    assert lut.parse_key("Logits-input:7x7x1280-output:1000").output == (1000,)
    assert lut.parse_key("AvgPool2D-input:7x7x1152-output:1x1x1152").input == (7, 7, 1152)


@pytest.mark.parametrize("key, fragment", [
    ("conv3x3-input:224x224x3-output:112x112x32", "unknown layer kind 'conv3x3'"),
    ("Conv-input:224x224-output:112x112x32", "shape '224x224'"),
    ("Conv-input:224x224x3", "fields ['input']"),
    ("Conv-input:224x224x3-output:112x112x32-kernel:3", "fields ['input', 'output', 'kernel']"),
    ("expanded_conv-input:7x7x8-output:7x7x8-expand:3-kernel:3-stride:1", "fields"),
    ("expanded_conv-input:7x7x8-output:7x7x8-expand:3-kernel:3-stride:1-idskip:2", "idskip must be 0 or 1"),
    ("expanded_conv-input:7x7x8-output:7x7x8-expand:x-kernel:3-stride:1-idskip:0", "expand:'x'"),
    ("expanded_conv-input:7x7x8-output:7x7x8-expand:3-kernel:3-stride:0-idskip:0", "stride must be >= 1"),
    ("Conv-input:224x224x3-output", "not a unique 'name:value'"),
])
def test_parse_key_rejects_malformed_keys(key, fragment):
    with pytest.raises(lut.LUTError, match="table key") as e:
        lut.parse_key(key)
    assert key in str(e.value) and fragment in str(e.value)


GOOD = "Conv-input:224x224x3-output:112x112x32"


@pytest.mark.parametrize("entry, fragment", [
    ({"count": 3, "var": 0.1}, "'mean'"),
    ({"count": 3, "mean": -1.0}, "mean is -1.0"),
    ({"count": 3, "mean": ".nan"}, "mean is nan"),
    ({"count": 3, "mean": "fast"}, "mean is 'fast'"),
    ({"count": 3, "mean": 1.0, "std": -0.5}, "std is -0.5"),
    ({"count": 0, "mean": 1.0}, "count is 0"),
    (2.5, "expected a mapping"),
])
def test_load_rejects_malformed_entries(tmp_path, entry, fragment):
    body = {GOOD: {"count": 1, "mean": 1.0}, "Logits-input:7x7x1280-output:1000": entry}
    text = json.dumps(body).replace('".nan"', ".nan")  # JSON is YAML; .nan is YAML's NaN
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(lut.LUTError) as e:
        lut.load_lut(p)
    assert "Logits-input:7x7x1280-output:1000" in str(e.value) and fragment in str(e.value)


def test_load_rejects_bad_key_and_non_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("Conv-input:224x224x3-output:112x112x32:\n  mean: 1.0\nLogits-input:7x7x1280:\n  mean: 1.0\n")
    with pytest.raises(lut.LUTError, match="'Logits-input:7x7x1280'"):
        lut.load_lut(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(lut.LUTError, match="non-empty mapping"):
        lut.load_lut(p)
    with pytest.raises(lut.LUTError, match="cannot read"):
        lut.load_lut(tmp_path / "absent.yaml")


# ------------------------------------------------------------------------------------------- real tables


def test_real_tables_load_and_keys_round_trip():
    t = lut.load_lut(PROXYLESS / "mobile_trim.yaml")
    assert (t.flavor, len(t.entries)) == ("proxyless", 72)
    assert t.entries["Conv-input:224x224x3-output:112x112x32"] == pytest.approx(4.083755600814664)
    for path in [PROXYLESS / "mobile_trim.yaml"] + sorted(OFA.glob("*_lookup_table.yaml")):
        t = lut.load_lut(path)
        assert all(lut.format_key(k) == s for s, k in t.keys.items())
        assert all(v > 0 and math.isfinite(v) for v in t.entries.values())
    assert lut.load_lut(OFA / "224_lookup_table.yaml").flavor == "ofa"


MOBILE_MISSING = (  # the 32-channel stage of proxyless_mobile; mobile_trim.yaml has 24 and 40 channels there
    ("blocks.1", "expanded_conv-input:112x112x16-output:56x56x32-expand:3-kernel:5-stride:2-idskip:0"),
    ("blocks.2", "expanded_conv-input:56x56x32-output:56x56x32-expand:3-kernel:3-stride:1-idskip:1"),
    ("blocks.5", "expanded_conv-input:56x56x32-output:28x28x40-expand:3-kernel:7-stride:2-idskip:0"),
)


def test_proxyless_mobile_lists_every_missing_key():
    t = lut.load_lut(PROXYLESS / "mobile_trim.yaml")
    with pytest.raises(lut.MissingKeysError) as e:
        lut.network_latency(t, lut.arch_layers(_config("mobile")))
    assert e.value.missing == MOBILE_MISSING
    assert str(e.value).startswith("3 layer key(s) missing from latency table mobile_trim.yaml")
    assert all(k in str(e.value) for _, k in MOBILE_MISSING)


@pytest.mark.parametrize("name, n_missing, n_layers", [("cpu", 23, 23), ("gpu", 17, 17)])
def test_proxyless_cpu_gpu_configs_use_widths_the_mobile_table_lacks(name, n_missing, n_layers):
    """The CPU/GPU nets start with a 40-channel stem and use widths (24->32/48/88/104/216/360 on CPU,
    32/56/112/128/256/432 on GPU) measured for other devices: every one of their layers is missing."""
    t = lut.load_lut(PROXYLESS / "mobile_trim.yaml")
    layers = lut.arch_layers(_config(name))
    assert len(layers) == n_layers  # ZeroLayer blocks give no key
    with pytest.raises(lut.MissingKeysError) as e:
        lut.network_latency(t, layers)
    assert len(e.value.missing) == n_missing
    assert e.value.missing[0] == ("first_conv", "Conv-input:224x224x3-output:112x112x40")
    assert all(k not in t.entries for _, k in e.value.missing)


def _mobile_with_24_channels():
    """proxyless_mobile with its 32-channel stage narrowed to 24 channels (MobileNetV2's width there)."""
    cfg = copy.deepcopy(_config("mobile"))
    for blk in cfg["blocks"][1:6]:
        conv = blk["mobile_inverted_conv"]
        for f in ("in_channels", "out_channels"):
            if conv.get(f) == 32:
                conv[f] = 24
    return cfg


EXPECTED_24 = [  # written out by hand from the config (ZeroLayer blocks 3 and 4 run nothing)
    "Conv-input:224x224x3-output:112x112x32",
    "expanded_conv-input:112x112x32-output:112x112x16-expand:1-kernel:3-stride:1-idskip:0",
    "expanded_conv-input:112x112x16-output:56x56x24-expand:3-kernel:5-stride:2-idskip:0",
    "expanded_conv-input:56x56x24-output:56x56x24-expand:3-kernel:3-stride:1-idskip:1",
    "expanded_conv-input:56x56x24-output:28x28x40-expand:3-kernel:7-stride:2-idskip:0",
    "expanded_conv-input:28x28x40-output:28x28x40-expand:3-kernel:3-stride:1-idskip:1",
    "expanded_conv-input:28x28x40-output:28x28x40-expand:3-kernel:5-stride:1-idskip:1",
    "expanded_conv-input:28x28x40-output:28x28x40-expand:3-kernel:5-stride:1-idskip:1",
    "expanded_conv-input:28x28x40-output:14x14x80-expand:6-kernel:7-stride:2-idskip:0",
] + ["expanded_conv-input:14x14x80-output:14x14x80-expand:3-kernel:5-stride:1-idskip:1"] * 3 + [
    "expanded_conv-input:14x14x80-output:14x14x96-expand:6-kernel:5-stride:1-idskip:0",
] + ["expanded_conv-input:14x14x96-output:14x14x96-expand:3-kernel:5-stride:1-idskip:1"] * 3 + [
    "expanded_conv-input:14x14x96-output:7x7x192-expand:6-kernel:7-stride:2-idskip:0",
    "expanded_conv-input:7x7x192-output:7x7x192-expand:6-kernel:7-stride:1-idskip:1",
    "expanded_conv-input:7x7x192-output:7x7x192-expand:3-kernel:7-stride:1-idskip:1",
    "expanded_conv-input:7x7x192-output:7x7x192-expand:3-kernel:7-stride:1-idskip:1",
    "expanded_conv-input:7x7x192-output:7x7x320-expand:6-kernel:7-stride:1-idskip:0",
    "Conv_1-input:7x7x320-output:7x7x1280",
    "Logits-input:7x7x1280-output:1000",
]


def test_proxyless_latency_sums_hand_listed_keys():
    t = lut.load_lut(PROXYLESS / "mobile_trim.yaml")
    res = lut.network_latency(t, lut.arch_layers(_mobile_with_24_channels()))
    assert list(res.keys.values()) == EXPECTED_24
    assert "blocks.3" not in res.per_layer and "blocks.4" not in res.per_layer
    assert res.total_ms == pytest.approx(sum(t.entries[k] for k in EXPECTED_24), rel=1e-12)
    assert res.total_ms == pytest.approx(sum(res.per_layer.values()), rel=1e-12)


@pytest.mark.parametrize("r", [160, 176, 192, 208, 224])
def test_ofa_space_covers_exactly_the_table(r):
    """All kernel/expand choices at full depth produce exactly the table's keys (so key building matches)."""
    t = lut.load_lut(OFA / f"{r}_lookup_table.yaml")
    seen = set()
    for ks, e in itertools.product((3, 5, 7), (3, 4, 6)):
        seen |= set(dict(lut.ofa_spec_layers({"ks": [ks] * 20, "e": [e] * 20, "d": [4] * 5, "r": [r]})).values())
    assert seen == set(t.entries)


def test_ofa_spec_latency_and_odd_sizes():
    t = lut.load_lut(OFA / "176_lookup_table.yaml")
    spec = {"ks": [3, 5, 7, 3] * 5, "e": [3, 4, 6, 6] * 5, "d": [2, 3, 4, 2, 3], "r": 176}
    res = lut.network_latency(t, lut.arch_layers(spec))
    assert len(res.per_layer) == 1 + 1 + 14 + 4  # stem, fixed block, sum(d) blocks, 4 tail layers
    # 176 -> 88 -> 44 -> 22 -> 11 -> 11 -> 6: the last stride-2 stage rounds 11/2 up
    assert res.keys["final_expand_layer"] == "Conv_1-input:6x6x192-output:6x6x1152"
    # stage 1 block 2: 32 channels in, e[1] = 4 -> 128 middle channels, ks[1] = 5, no SE/h-swish in stage 1
    assert res.keys["stage1.block2"] == ("expanded_conv-input:44x44x32-output:44x44x32-expand:128-kernel:5-"
                                         "stride:1-idskip:1-se:0-hs:0")
    assert res.total_ms == pytest.approx(sum(t.entries[k] for k in res.keys.values()))


def test_ofa_spec_rejects_bad_lists():
    with pytest.raises(lut.LUTError, match="'ks' must be a list of 20"):
        lut.arch_layers({"ks": [3] * 19, "e": [3] * 20, "d": [2] * 5, "r": 224})
    with pytest.raises(lut.LUTError, match=r"d = \[5, 2, 2, 2, 2\]"):
        lut.arch_layers({"ks": [3] * 20, "e": [3] * 20, "d": [5, 2, 2, 2, 2], "r": 224})
    with pytest.raises(lut.LUTError, match="lacks field 'r'"):
        lut.arch_layers({"ks": [3] * 20, "e": [3] * 20, "d": [2] * 5})
    with pytest.raises(lut.LUTError, match="neither a net.config"):
        lut.arch_layers({"layers": []})


def test_flavor_mismatch_is_explained():
    t = lut.load_lut(OFA / "224_lookup_table.yaml")
    with pytest.raises(lut.MissingKeysError, match="ofa table but the architecture gives proxyless keys"):
        lut.network_latency(t, lut.arch_layers(_mobile_with_24_channels()))


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_json(tmp_path, capsys):
    arch = tmp_path / "arch.json"
    arch.write_text(json.dumps({"ks": [7] * 20, "e": [6] * 20, "d": [4] * 5, "r": 224}))
    rc = cli.main(["latency", "--table", str(OFA / "224_lookup_table.yaml"), "--arch", str(arch), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    t = lut.load_lut(OFA / "224_lookup_table.yaml")
    assert out["latency_ms"] == pytest.approx(sum(t.entries[k] for k in out["keys"].values()))
    assert out["latency_ms"] == pytest.approx(sum(out["per_layer"].values()))
    assert len(out["per_layer"]) == 26


def test_cli_text_and_errors(tmp_path, capsys):
    table = str(PROXYLESS / "mobile_trim.yaml")
    arch = tmp_path / "net.config"
    arch.write_text(json.dumps(_mobile_with_24_channels()))
    assert cli.main(["latency", "--table", table, "--arch", str(arch)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("first_conv") and out[-1].startswith("total") and len(out) == len(EXPECTED_24) + 1

    rc = cli.main(["latency", "--table", table, "--arch", str(PROXYLESS / "proxyless_mobile.config"), "--json"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jmsnas latency: error: 3 layer key(s) missing")
    assert all(k in lines[0] for _, k in MOBILE_MISSING)

    assert cli.main(["latency", "--table", str(tmp_path / "none.yaml"), "--arch", str(arch)]) == 2
    assert capsys.readouterr().err.startswith("jmsnas latency: error: cannot read latency table")
    arch.write_text("{not json")
    assert cli.main(["latency", "--table", table, "--arch", str(arch)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def _ofa_net_config(spec):
    """The OFA MobileNetV3 net.config (ResidualBlock / MBConvLayer format) of an OFA arch spec."""
    def conv(cin, cout, k, s, mid, se, act):
        return {"name": "MBConvLayer", "in_channels": cin, "out_channels": cout, "kernel_size": k, "stride": s,
                "expand_ratio": mid / cin, "mid_channels": mid, "act_func": act, "use_se": se}
    identity = {"name": "IdentityLayer"}
    blocks = [{"name": "ResidualBlock", "conv": conv(24, 24, 3, 1, 24, False, "relu"), "shortcut": identity}]
    cin = 24
    for s, (width, stride, se, hs) in enumerate(zip((32, 48, 96, 136, 192), (2, 2, 2, 1, 2),
                                                    (False, True, False, True, True), (0, 0, 1, 1, 1))):
        for j in range(spec["d"][s]):
            i = 4 * s + j
            c = conv(cin, width, spec["ks"][i], stride if j == 0 else 1, round(cin * spec["e"][i]), se,
                     "h_swish" if hs else "relu")
            blocks.append({"name": "ResidualBlock", "conv": c, "shortcut": identity if j else None})
            cin = width
    return {"name": "MobileNetV3", "first_conv": {"name": "ConvLayer", "out_channels": 24, "stride": 2},
            "blocks": blocks, "final_expand_layer": {"in_channels": 192, "out_channels": 1152},
            "feature_mix_layer": {"in_channels": 1152, "out_channels": 1536},
            "classifier": {"in_features": 1536, "out_features": 1000}, "resolution": spec["r"]}


def test_ofa_net_config_gives_the_same_keys_as_the_arch_spec():
    spec = {"ks": [3, 5, 7, 5] * 5, "e": [6, 3, 4, 4] * 5, "d": [4, 2, 3, 4, 2], "r": 208}
    from_spec = lut.arch_layers(spec)
    from_config = lut.arch_layers(_ofa_net_config(spec))
    assert [k for _, k in from_config] == [k for _, k in from_spec]
    t = lut.load_lut(OFA / "208_lookup_table.yaml")
    assert lut.network_latency(t, from_config).total_ms == pytest.approx(lut.network_latency(t, from_spec).total_ms)


def test_net_config_errors_name_the_block():
    cfg = _mobile_with_24_channels()
    del cfg["blocks"][6]["mobile_inverted_conv"]["kernel_size"]
    with pytest.raises(lut.LUTError, match=r"blocks\[6\] lacks field 'kernel_size'"):
        lut.arch_layers(cfg)
    cfg["blocks"][6]["mobile_inverted_conv"].update(kernel_size=3, expand_ratio="six")
    with pytest.raises(lut.LUTError, match=r"blocks\[6\] expand_ratio is 'six'"):
        lut.arch_layers(cfg)
