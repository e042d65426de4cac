"""Every bad input found by trying jmsnas as a new user (issue list ids in the test ids): one clear line naming the
bad value, exit code 2, nothing in the workdir changed, and everything refused before the workdir is touched
(no test here compiles a network)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tinyrun

from jmsnas import budget, cli, configs, pipeline, runcheck, safeio
from jmsnas.checkpoint import CheckpointError, Checkpointer
from jmsnas.commands import search as search_cmd
from jmsnas.run import directory, loop
from jmsnas.run import workdir as W

from paths import REPO


_digest = tinyrun.digest


def _fails(capsys, argv, *needles, code=2):
    got = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    err = out.err.strip()
    assert got == code, (got, out.out[-500:], err[-2000:])
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def workdir(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "precious.txt").write_text("keep me")
    return w


# ------------------------------------------------------------------------------------------ search settings

@pytest.mark.parametrize("override, needles", [
    ("--config.t_const_ms=true", ["t_const_ms", "true", "a number"]),  # C13
    ("--config.search.arch_lr=-1", ["search.arch_lr", "-1"]),  # C57
    ("--config.retrain.lr=-1", ["retrain.lr", "-1"]),  # C58
    ("--config.checkpoint_every=0", ["checkpoint_every", "0"]),  # C25
    ("--config.checkpoint_min_interval_s=-1.0", ["checkpoint_min_interval_s", ">= 0", "-1"]),
    ("--config.eval_batch_size=0", ["eval_batch_size", "0"]),  # C26
    ("--config.search.weight_lr=.nan", ["search.weight_lr", "nan"]),  # C37
    ("--config.search.tau_decay=1.5", ["search.tau_decay", "1.5"]),
    ("--config.seed=-3", ["seed", "-3"]),
    ("--config.search.epochs=2.5", ["search.epochs", "integer"]),
    ("--config.shared_weights=3", ["shared_weights", "true or false"]),
    ("--config.space.device_channels=[8, -8, 8, 8]", ["space.device_channels", "-8"]),
    ("--config.search=3", ["search", "keys of its own"]),
    ("--config.t_const_ms=!!python/object/apply:os.system [echo]", ["t_const_ms", "YAML"]),  # C66
    ("--config.t_const_ms=[1,1,", ["t_const_ms", "not valid YAML"]),  # C67
    ("--config.t_const_ms=" + "[" * 5000, ["t_const_ms"]),
    ("--config.search.batch_size=100000", ["batch_size=100000", "train split"]),  # K17 (checked after loading data)
    ("--config.image_size=4096", ["image_size=4096", "GiB"]),  # C56: refused before resizing or compiling
    ("--config.max_train=5", ["batch_size", "train split"]),  # C36-C62 family: data too small for a batch
    ("--config.cost.tables={nowhere: {kind: roofline}}", ["nowhere"]),
])
def test_bad_settings_refused_before_the_workdir_is_created(capsys, tmp_path, override, needles):
    w = tmp_path / "new"
    _fails(capsys, ["search", "--workdir", w, override], *needles)
    assert not w.exists()  # K17: nothing prepared, so the corrected rerun is not refused


def test_overrides_that_yaml_reads_as_strings_are_numbers():  # C63, C64
    cfg = configs.apply_overrides(configs.load_config(None), ["--config.search.arch_lr=2e-3",
                                                                    "--config.retrain.lr=5E-4"])
    assert cfg.search.arch_lr == pytest.approx(2e-3) and cfg.retrain.lr == pytest.approx(5e-4)
    pipeline.validate_config(cfg)


def test_config_file_with_a_syntax_error(capsys, tmp_path, workdir):  # C45
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n    pass\n")
    before = _digest(workdir)
    _fails(capsys, ["search", "--config", bad, "--workdir", workdir], "syntax error", "line 1")
    raising = tmp_path / "raising.py"
    raising.write_text("def get_config():\n    raise KeyError('oops')\n")
    _fails(capsys, ["search", "--config", raising, "--workdir", workdir], "get_config()", "KeyError")
    assert _digest(workdir) == before


def test_multi_line_errors_are_printed_on_one_line(capsys, tmp_path):  # C68
    table = tmp_path / "t.yaml"
    table.write_text("Conv-input:8x8x1-output:8x8x16: {mean: 0.1}\n")
    spec = "{ue: {kind: lut, path: %s}}" % table
    err = _fails(capsys, ["search", "--workdir", tmp_path / "w", f"--config.cost.tables={spec}"], "missing")
    assert "expanded_conv" in err
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------ the workdir

@pytest.mark.parametrize("files", [
    ["result.json", "history.json", "history.png", "parts/manifest.json", "parts/ue.npz"],  # K12: checkpoints/ gone
    ["summary.txt"], ["result.json"], ["parts/manifest.json"],  # K14: the user's own files
    ["config.json"], ["evolution.json"], ["checkpoints/search/marker"],
])
def test_a_workdir_holding_any_run_output_is_refused(capsys, workdir, files):
    for f in files:
        (workdir / f).parent.mkdir(parents=True, exist_ok=True)
        (workdir / f).write_text("user data")
    before = _digest(workdir)
    _fails(capsys, ["search", "--workdir", workdir, "--config.t_const_ms=0.8"], "already holds a run", "--resume")
    assert _digest(workdir) == before


def test_empty_checkpoint_folders_do_not_block_a_new_run(workdir):  # K17: left by an old refused run
    (workdir / "checkpoints" / "search").mkdir(parents=True)
    W.check_workdir(str(workdir), False, {}, "search")


def _fake_run(workdir, config, command="search"):
    (workdir / "checkpoints" / "search" / "4").mkdir(parents=True)
    (workdir / "checkpoints" / "search" / "4" / "x").write_text("x")
    (workdir / "config.json").write_text(json.dumps({"command": command, "config": W.plain(config)}))


def test_resume_names_the_setting_that_changed(capsys, workdir):  # K02, K15
    _fake_run(workdir, configs.load_config(None))
    before = _digest(workdir)
    _fails(capsys, ["search", "--resume", "--workdir", workdir, "--config.search.epochs=3"],
           "search.epochs: stored 8, now 3")
    _fails(capsys, ["retrain", "--workdir", workdir, "--config.t_const_ms=2.5"], "t_const_ms: stored 2.8, now 2.5")
    assert _digest(workdir) == before


def test_retrain_reads_the_stored_config(workdir):  # K15: `jmsnas retrain --workdir DIR` for any run
    cfg = configs.load_config(None)
    cfg.t_const_ms, cfg.search.epochs, cfg.space.device_channels = 2.5, 3, (8, 8, 8, 8)
    _fake_run(workdir, cfg)
    args = cli.argparse.Namespace(command="retrain", workdir=str(workdir), config=None)
    got = search_cmd.run_config(args, [])
    assert W.plain(got) == W.plain(cfg)
    assert got.space.device_channels == (8, 8, 8, 8)
    assert W.fingerprint(got) == W.fingerprint(cfg)
    W.check_workdir(str(workdir), True, W.plain(got), "retrain")


def test_evolve_resume_on_a_search_workdir_is_refused_at_once(capsys, workdir):  # V06
    _fake_run(workdir, configs.load_config(None), "search")
    before = _digest(workdir)
    _fails(capsys, ["evolve", "--resume", "--workdir", workdir], "`jmsnas search` run")
    assert _digest(workdir) == before


def test_unwritable_outputs_are_one_line_and_keep_the_checkpoints(tmp_path):  # E08
    (tmp_path / "result.json").mkdir()  # root ignores permission bits: a directory in the way fails the same
    with pytest.raises(runcheck.ConfigError, match="cannot write the run's outputs") as info:
        directory.write_json(str(tmp_path), "result.json", {})
    assert "--resume" in str(info.value) and "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["result.json"]  # no temporary file left


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path):
    p = tmp_path / "result.json"
    p.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with safeio.atomic_write(str(p)) as f:
            f.write("half")
            raise KeyboardInterrupt
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


# ------------------------------------------------------------------------------------------ checkpoints

def _saved(tmp_path, meta=None):
    d = tmp_path / "ck"
    state = {"alpha": np.arange(2 * 13, dtype=np.float32).reshape(2, 13),
             "w": np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)}
    with Checkpointer(str(d)) as c:
        c.save(4, state, meta or {"epoch": 1, "batch": 0, "history": [], "fingerprint": "f"})
    return d, state


def _data_files(d):
    return sorted((os.path.join(r, f) for r, _, fs in os.walk(d / "4" / "state") for f in fs
                   if os.path.basename(r) == "d"), key=os.path.getsize)


@pytest.mark.parametrize("damage", ["random-bytes", "truncated"])  # K06, K05, K11
def test_damaged_checkpoint_data_is_caught_by_its_checksum(tmp_path, damage):
    d, state = _saved(tmp_path)
    big = _data_files(d)[-1]
    size = os.path.getsize(big)
    with open(big, "r+b") as f:
        if damage == "random-bytes":  # same length: orbax reads it without complaint
            f.seek(size // 3)
            f.write(np.random.default_rng(0).bytes(min(1000, size // 3)))
        else:
            f.truncate(size // 2)
    before = _digest(d)
    with Checkpointer(str(d)) as c, pytest.raises(CheckpointError, match="changed since it was saved") as info:
        c.restore(state)
    assert "\n" not in str(info.value)
    assert _digest(d) == before


def test_checkpoint_meta_of_the_wrong_type(tmp_path):  # K08
    d, state = _saved(tmp_path, {"epoch": "abc", "batch": 0, "history": [], "fingerprint": "f"})
    with Checkpointer(str(d)) as c, pytest.raises(CheckpointError, match="meta 'epoch' is 'abc', expected an int"):
        c.restore(state, meta_types=loop.META_TYPES)


NOISE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from jmsnas.checkpoint import Checkpointer, CheckpointError, CHECKSUMS
    d = sys.argv[1]
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.normal(size=(64, 64)).astype(np.float32) for i in range(8)}
    with Checkpointer(d) as c:
        c.save(1, state, {})
    os.remove(os.path.join(d, "1", CHECKSUMS))  # damaged after: reopening stores checksums of the damaged files, so orbax meets it
    for r, _, fs in os.walk(os.path.join(d, "1", "state")):
        for f in fs:
            if os.path.basename(r) == "d" and os.path.getsize(os.path.join(r, f)) > 4000:
                os.truncate(os.path.join(r, f), 0)
    try:
        Checkpointer(d).restore(state)
    except CheckpointError as e:
        print("ERROR", e)
""")


@pytest.mark.slow
def test_no_event_loop_tracebacks_after_a_failed_restore(tmp_path):  # K05, K11
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", NOISE, str(tmp_path / "ck")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert "ERROR" in out.stdout and "corrupt or unreadable" in out.stdout, out.stderr[-3000:]
    assert "Event loop is closed" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_nan_alpha_is_a_clear_error():  # C37, E05
    from jmsnas.topology import presets
    from jmsnas.cost.tables import analytic_table
    from jmsnas.space import build_space
    sp = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=8, in_channels=1, num_classes=10,
                     device_channels=(8, 8, 8, 8), device_strides=(1, 2, 1, 2))
    alpha = np.full(sp.mask().shape, np.nan, np.float32)
    with pytest.raises(ValueError, match="NaN"):
        budget.repair(sp, analytic_table(sp), alpha, np.zeros(sp.num_layers, np.int32), 0.1)
    with pytest.raises(runcheck.ConfigError, match="diverged"):
        pipeline.check_alpha(alpha)


# ------------------------------------------------------------------------------------------ files given to commands

def _lut_line(mean="0.1"):
    return f"Conv-input:224x224x3-output:112x112x32: {{count: 3, mean: {mean}}}\n"


LAUGHS = "[&a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(
    f"&a{i} [*a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}]"
    for i in range(1, 10)) + "]"  # 10**10 strings behind ~100 shared lists


@pytest.mark.parametrize("content, needles", [
    ("[" * 100_000, ["nested more than"]),  # F13: segfault in the C loader before
    (_lut_line() + _lut_line("0.2"), ["defined twice", "line 2"]),  # F33
    (b"\xff\xfe" + _lut_line().encode(), ["not UTF-8"]),  # F03
    ("Conv-input:224x224x3-output:112x112x32: {count: 3, mean: 0.1, var: %s}\n" % LAUGHS,
     ["var is [[", "expected a finite number"]),  # F12: a spare field holding a billion laughs
])
def test_bad_latency_tables(capsys, tmp_path, content, needles):
    table = tmp_path / "t.yaml"
    (table.write_bytes if isinstance(content, bytes) else table.write_text)(content)
    arch = tmp_path / "a.json"
    arch.write_text(json.dumps({"ks": [3] * 20, "e": [3] * 20, "d": [2] * 5, "r": 224}))
    err = _fails(capsys, ["latency", "--table", table, "--arch", arch], *needles)
    assert len(err) < 600


@pytest.mark.parametrize("patch, needles", [
    (lambda a: a["e"].__setitem__(0, 1e308), ["e[0]", "1e+308"]),  # F19
    (lambda a: a["e"].__setitem__(0, float("inf")), ["e[0]", "inf"]),  # F20 (JSON Infinity)
    (lambda a: a["ks"].__setitem__(0, 10 ** 400), ["ks[0]"]),
])
def test_bad_ofa_archs(capsys, tmp_path, patch, needles):
    table = tmp_path / "t.yaml"
    table.write_text(_lut_line())
    arch = {"ks": [3] * 20, "e": [3] * 20, "d": [2] * 5, "r": 224}
    patch(arch)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(arch))
    _fails(capsys, ["latency", "--table", table, "--arch", path], *needles)


def test_unknown_net_config_block(capsys, tmp_path):  # F26
    conv = {"name": "DefinitelyNotAnOp", "in_channels": 32, "out_channels": 16, "kernel_size": 3, "stride": 1,
            "expand_ratio": 1}
    cfg = {"first_conv": {"out_channels": 32, "stride": 2}, "blocks": [{"mobile_inverted_conv": conv}],
           "feature_mix_layer": {"in_channels": 16, "out_channels": 1280}, "classifier": {"out_features": 1000}}
    table, arch = tmp_path / "t.yaml", tmp_path / "a.json"
    table.write_text(_lut_line())
    arch.write_text(json.dumps(cfg))
    _fails(capsys, ["latency", "--table", table, "--arch", arch], "DefinitelyNotAnOp", "MBInvertedConvLayer")


def test_space_file_not_utf8(capsys, tmp_path):  # P07
    space = tmp_path / "space.yaml"
    space.write_bytes(b"image_size: 8\n\xff\n")
    out = tmp_path / "ue.yaml"
    _fails(capsys, ["profile", "--space", space, "--out", out], "not UTF-8")
    assert not out.exists()


def _net(**layer):
    l = dict(name="c1", kind="conv", macs=1000, params=10, out_shape=[8, 8, 4], inputs=[])
    l.update(layer)
    return {"name": "n", "input_shape": [8, 8, 3], "layers": [l]}


@pytest.mark.parametrize("net, needles", [
    (_net(macs=-1e12), ["macs=-1000000000000", ">= 0"]),  # S05
    (_net(out_shape=[8, -8, 4]), ["out_shape", "positive"]),  # S06
    (_net(macs=float("inf")), ["not a network description"]),
])
def test_bad_network_files(capsys, tmp_path, net, needles):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(net))
    _fails(capsys, ["split", "--model", path, "--topology", "chain"], *needles)


@pytest.mark.slow
def test_closed_pipe_ends_quietly(tmp_path):  # S26: `jmsnas split ... | head -2`
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "split", "--model", "resnet152", "--topology", "chain",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader is gone before the command writes (its start-up takes seconds)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


TFDS = textwrap.dedent("""
    import os, sys
    from jmsnas import cli
    root = sys.argv[1]
    os.makedirs(os.path.join(root, "badjson", "cifar10", "3.0.2"))
    with open(os.path.join(root, "badjson", "cifar10", "3.0.2", "dataset_info.json"), "w") as f:
        f.write("{not json")
    os.makedirs(os.path.join(root, "empty", "cifar10", "3.0.2"))
    for d in ("badjson", "empty", "missing"):
        code = cli.main(["search", "--workdir", os.path.join(root, "w"), "--config.dataset=cifar10",
                         "--config.data_dir=" + os.path.join(root, d)])
        print("CODE", code, flush=True)
""")


@pytest.mark.slow
def test_tfds_folder_errors_are_one_line_without_tensorflow_logs(tmp_path):  # D01-D06
    pytest.importorskip("tensorflow_datasets")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", TFDS, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.stdout.split() == ["CODE", "2"] * 3, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("jmsnas search: error:") for ln in lines), out.stderr[-3000:]
    assert "dataset_info" in lines[0] or "JSON" in lines[0]
    assert "not prepared" in lines[1] and "--config.data_dir=DIR" in lines[2]
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------ YAML and reprs

def test_short_never_expands_a_billion_laughs():
    import yaml
    obj = yaml.safe_load(LAUGHS)
    assert len(safeio.short(obj)) <= 120


# ------------------------------------------------------------------------------------------ profiler under load

@pytest.mark.parametrize("offset", [-2.2571, float("nan")])  # -2.26 ms: a fit seen under a load average of 21
def test_noisy_network_offset_never_makes_a_latency_negative(tmp_path, offset):
    from jmsnas.topology import presets
    from jmsnas.cost import build as B
    from jmsnas.cost import profile as P
    from jmsnas.space import build_space
    sp = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=4, in_channels=1, num_classes=3,
                     device_channels=(8, 12, 12, 16), device_strides=(1, 2, 1, 1), stem_channels=8, head_channels=16)
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {n: P.Timing(0.01, 0.0, 5) for n, m in zip(P.OP_NAMES, sp.mask()[s.index])
                           if m and n != "identity"}} for s in sp.layers)
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(sp), slots, P.Timing(0.04, 0, 5), 0.001,
                        P.Timing(0.02, 0, 5), P.Timing(0.03, 0, 5), {"method": "in-network", "networks": 4,
                                                                      "offset_ms": 0.0})
    with pytest.warns(RuntimeWarning, match="clamped"):
        t = P._with_offset(t, offset)
    assert t.network["offset_ms"] == pytest.approx(-0.06)
    P.write_table(t, tmp_path / "ue.yaml")  # the writer's own check accepts it ...
    row = B.measured_row(sp, tmp_path / "ue.yaml")  # ... and so does the table build (it refused its own file)
    assert row.stem_ms >= 0 and np.all(np.isfinite(row.compute_ms)) and np.all(row.compute_ms >= 0)
