"""``jmsnas adapt`` / ``validate`` / ``measure`` on HELP's data, and remote timing on a ``jmsnas worker``
(jmsnas.deploy.timer)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jmsnas.cli import main
from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW
from jmsnas.deploy import timer
from jmsnas.fbnet import help as H
import paths

DATA = os.path.join(paths.DATA, "help_fbnet")
HELP_PIXEL3 = os.path.join(DATA, H.LUT_FILE) + ":pixel3"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("nets")
    data = H.load(DATA)
    NW.save(H.measured(data, "titan_rtx_32", data["reference"]), d / "ten.json")
    NW.save(H.measured(data, "titan_rtx_32", range(4000, 4100)), d / "test.json")
    return d


def test_adapt_then_validate_records_the_report(files, capsys):
    out = files / "titan.json"
    assert main(["adapt", "--table", HELP_PIXEL3, "--measured", str(files / "ten.json"), "--out", str(out)]) == 0
    assert "leave-one-out MAPE" in capsys.readouterr().out
    t = LT.load(out)
    assert t.device == "titan_rtx_32" and t.adaptation["networks"] == 10
    assert main(["validate", "--table", str(out), "--measured", str(files / "test.json"), "--json",
                 str(files / "v.json"), "--plot", str(files / "v.png")]) == 0
    rep = json.loads((files / "v.json").read_text())
    t = LT.load(out)
    assert t.validation["n"] == rep["n"] == 100 and t.validation["mape_pct"] == pytest.approx(rep["mape_pct"])
    pred = LT.predict_ms(t, NW.load(files / "test.json").archs)
    np.testing.assert_allclose(rep["predicted_ms"], pred)
    assert os.path.getsize(files / "v.png") > 1000


@pytest.mark.parametrize("argv, message", [
    (["adapt", "--table", HELP_PIXEL3 + "x", "--measured", "ten.json", "--out", "o.json"], "no device 'pixel3x'"),
    (["adapt", "--table", HELP_PIXEL3, "--measured", "missing.json", "--out", "o.json"], "cannot read measured"),
    (["adapt", "--table", HELP_PIXEL3, "--measured", "ten.json", "--out", "no/dir/o.json"], "does not exist"),
    (["validate", "--table", HELP_PIXEL3], "exactly one of --measured FILE or --networks N"),
    (["validate", "--table", HELP_PIXEL3, "--networks", "1"], "--networks must be an integer >= 2, got 1"),
    (["measure", "--space", "nope", "--networks", "2", "--out", "o.json"], "unknown search space 'nope'"),
    (["measure", "--networks", "2", "--out", "o.json", "--remote", "host"], "must be HOST:PORT"),
])
def test_bad_input_is_one_line_and_writes_nothing(files, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(files)
    before = sorted(os.listdir(files))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert sorted(os.listdir(files)) == before


@pytest.mark.parametrize("argv, message", [
    (["adapt", "--table", "ten.json", "--measured", "ten.json", "--out", "ten.json"], "--out ten.json is the --measured"),
    (["adapt", "--table", "titan.json", "--measured", "ten.json", "--out", "./titan.json"], "is the base table"),
    (["validate", "--table", "titan.json", "--measured", "ten.json", "--json", "ten.json"],
     "--json ten.json is the --measured file"),
    (["validate", "--table", "titan.json", "--measured", "ten.json", "--plot", "titan.json"], "--plot titan.json is the table"),
])
def test_an_output_onto_an_input_is_refused_before_any_work(files, monkeypatch, capsys, argv, message):
    """adapt --out onto its --measured file or base table, validate --json/--plot onto an input: one line, exit 2,
    the input unchanged (they were overwritten with exit 0)."""
    monkeypatch.chdir(files)
    if not (files / "titan.json").exists():
        assert main(["adapt", "--table", HELP_PIXEL3, "--measured", "ten.json", "--out", "titan.json"]) == 0
    before = {n: (files / n).read_bytes() for n in ("ten.json", "titan.json")}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert {n: (files / n).read_bytes() for n in before} == before


@pytest.mark.parametrize("ms", [1e-300, 1e308])
def test_an_implausible_measured_latency_is_refused_naming_the_network(files, tmp_path, capsys, ms):
    """Measured latencies of 1e-300 or 1e308 ms (a table scaled by ~1e-302, a 300-digit percentage): one line naming
    the network, for adapt and for validate."""
    d = json.loads((files / "ten.json").read_text())
    d["networks"][4]["ms"] = ms
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    for argv in (["adapt", "--table", HELP_PIXEL3, "--measured", str(bad), "--out", str(tmp_path / "t.json")],
                 ["validate", "--table", HELP_PIXEL3, "--measured", str(bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "networks[4].ms must be a latency of 1e-06-1e+07 ms" in err and err.count("\n") == 1, err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_remote_timing_is_the_workers_calibrate_message(monkeypatch):
    """``jmsnas measure --remote`` times on a ``jmsnas worker`` (the pipeline's): every program one part of one
    session, timed by the worker's {"calibrate"} message; a program the worker refuses and an address where no
    worker listens are one-line errors."""
    import socket
    import subprocess
    import sys
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    srv.close()
    repo = paths.REPO
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "worker", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        from jmsnas.fbnet import measure, space as SP
        prog = export.export(jax.jit(lambda x: jnp.tanh(x @ x)))(jax.ShapeDtypeStruct((16, 16), jnp.float32))
        tiny = SP.scaled(SP.fbnet_c100(), width=0.125, image_size=8)  # an FBNet network as jmsnas measure sends it
        fbnet = measure.export_network(tiny, [0, 1, 2, 3, 4, 5, 6, 7, 8] * 2 + [8] * 4)
        ms = timer.time_programs(f"127.0.0.1:{port}", [bytes(prog.serialize()), fbnet], reps=3, warmup=0)
        assert len(ms) == 2 and all(0 < m < 1000 for m in ms)
        manifest, blob, _ = timer.program_part(bytes(prog.serialize()))
        assert manifest["parts"]["program"]["inputs"] == [{"shape": [16, 16], "dtype": "float32", "from": "image"}]
        real = timer.program_part  # a program from a newer jax: the worker's own version check answers, one line
        newer = lambda m: {**m, "versions": {**m["versions"], "serialization_version": 999}}
        monkeypatch.setattr(timer, "program_part", lambda b: (newer(real(b)[0]),) + real(b)[1:])
        with pytest.raises(ValueError, match="the worker at .* failed: part 'program' was exported by") as e:
            timer.time_programs(f"127.0.0.1:{port}", [bytes(prog.serialize())], reps=1)
        assert "\n" not in str(e.value)
    finally:
        proc.terminate()
        proc.wait(10)
    with pytest.raises(ValueError, match="cannot reach the worker"):
        timer.time_programs(f"127.0.0.1:{port}", [bytes(prog.serialize())], reps=1)


LIB = os.path.join(paths.REPO, "jmsnas", "fbnet", "library")
OTHERS = [os.path.join(LIB, f"{d}.json") for d in ("silver_4114", "silver_4210r", "samsung_a50", "pixel3", "raspi4")]


def test_adapt_with_the_library_prints_the_expected_error_and_validate_its_calibration(files, capsys):
    out = files / "titan_lib.json"
    assert main(["adapt", "--table", HELP_PIXEL3, "--measured", str(files / "ten.json"), "--out", str(out),
                 "--library", *OTHERS]) == 0
    text = capsys.readouterr().out
    assert "a library of 5" in text and "90% interval: prediction ±" in text
    assert "expected error at 10 networks" in text and "with 10 more (20)" in text
    t = LT.load(out)
    assert t.adaptation["library"] == ["pixel3", "raspi4", "samsung_a50", "silver_4114", "silver_4210r"]
    assert main(["validate", "--table", str(out), "--measured", str(files / "test.json"), "--json",
                 str(files / "vl.json")]) == 0
    assert "inside the 90% interval:" in capsys.readouterr().out
    rep = json.loads((files / "vl.json").read_text())
    inside = np.mean([lo <= y <= hi for lo, y, hi in zip(rep["interval_low_ms"], rep["measured_ms"],
                                                          rep["interval_high_ms"])])
    assert rep["interval_coverage_pct"] == pytest.approx(100 * inside)
    assert LT.load(out).validation["interval_coverage_pct"] == rep["interval_coverage_pct"]


def test_adapt_fit_fits_a_table_and_stores_its_held_out_validation(files, capsys):
    """600 networks timed by the Raspberry Pi 4 table (additive): the fitted table predicts its held-out 60 exactly."""
    rpi = H.tables(DATA)["raspi4"]
    archs = np.random.default_rng(0).integers(0, 9, (600, 22))
    NW.save(NW.make(archs, LT.predict_ms(rpi, archs), rpi.op_names, space=rpi.space, device="rpi"),
            files / "many.json")
    assert main(["adapt", "--fit", str(files / "many.json"), "--out", str(files / "fit.json")]) == 0
    assert "on 540 networks; held-out 60: within ±10% 100.0%" in capsys.readouterr().out
    t = LT.load(files / "fit.json")
    assert t.validation["n"] == 60 and t.validation["mape_pct"] < 1e-6


def _bad_library_files(d):
    (d / "not_a_table.json").write_text(json.dumps({"format": "something else"}))
    other = json.loads(open(OTHERS[0]).read())
    other["space"] = "mbconv13"
    (d / "other_space.json").write_text(json.dumps(other))
    m = json.loads((d / "ten.json").read_text())
    (d / "empty.json").write_text(json.dumps({**m, "networks": []}))
    (d / "nan.json").write_text(json.dumps({**m, "networks": [{**m["networks"][0], "ms": float("nan")}]}))
    (d / "neg.json").write_text(json.dumps({**m, "networks": [{**m["networks"][0], "ms": -2.0}]}))


@pytest.mark.parametrize("change, message", [
    (["--library", "not_a_table.json"], "not a per-layer latency table (format 'something else'"),
    (["--library", "other_space.json"], "the library is of space 'mbconv13'"),
    (["--library", os.path.join(LIB, "titan_rtx_32.json")], "a table of the target device 'titan_rtx_32'"),
    (["--library", "shipped"], "a table of the target device 'titan_rtx_32'"),
    (["--measured", "empty.json"], "no measured networks"),
    (["--measured", "nan.json"], "networks[0].ms must be a latency of 1e-06-1e+07 ms (a plausible time for one network), got nan"),
    (["--measured", "neg.json"], "networks[0].ms must be a latency of 1e-06-1e+07 ms (a plausible time for one network), got -2.0"),
])
def test_bad_adapt_input_is_one_line_and_keeps_what_was_saved(files, monkeypatch, capsys, change, message):
    monkeypatch.chdir(files)
    _bad_library_files(files)
    (files / "kept.json").write_text("saved before")
    argv = ["adapt", "--table", HELP_PIXEL3, "--measured", "ten.json", "--library", *OTHERS, "--out", "kept.json"]
    i = argv.index(change[0])
    argv[i:i + (2 if change[0] == "--measured" else 1 + len(OTHERS))] = change
    before = {p: open(p, "rb").read() for p in sorted(os.listdir(files)) if os.path.isfile(p)}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert {p: open(p, "rb").read() for p in sorted(os.listdir(files)) if os.path.isfile(p)} == before
