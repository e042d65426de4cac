"""The commands' boundaries (issue 33): every example of the census as a test of its behaviour. Names that become
file names are checked before anything runs, outputs never land in another run's files or outside their folder,
a full disk or a busy workdir is one line with nothing partial left, multi-process start-up failures end every
process with one line, and a damaged latest checkpoint names the older intact one."""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import procs
import tinyrun
from jmsnas import cli, safeio
from jmsnas.run import workdir as W
from jmsnas.checkpoint import CheckpointError, Checkpointer

from paths import REPO
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)


def fails(capsys, argv, *needles, code=2):
    """Runs the CLI in-process: exit ``code`` and exactly one line on stderr holding every needle."""
    got = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    err = out.err.strip()
    assert got == code, (got, out.out[-500:], err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def run(tiny_run):
    """A finished tiny run (parts/, result.json, config.json): this test's own copy of conftest's tiny_run."""
    return str(tiny_run)


def _topology(path, names, dup=False):
    devs = "".join(f"  - {{name: {json.dumps(n)}, preset: raspberry_pi4}}\n" for n in names)
    links = "".join(f"  - {{src: {json.dumps(a)}, dst: {json.dumps(b)}, mbps: 10}}\n" for a, b in zip(names, names[1:]))
    path.write_text(f"devices:\n{devs}links:\n{links}" + ("links: []\n" if dup else ""))
    return path


# ----------------------------------------------------------------------------------- names that become file names

@pytest.mark.parametrize("bad", ["/abs/path", "../../../x", "cam/left", "..", "a\\b", "x" * 65, "nul\x00"])
def test_device_names_that_leave_a_folder_are_refused_before_anything_runs(capsys, tmp_path, bad):
    topo = _topology(tmp_path / "t.yaml", ["ue", bad, "cloud"])
    w = tmp_path / "w"
    before = tinyrun.digest(tmp_path)
    fails(capsys, ["search", "--workdir", w, f"--config.topology={topo}"], "devices[1].name")
    fails(capsys, ["search", "--workdir", w, "--resume", f"--config.topology={topo}"], "devices[1].name")
    fails(capsys, ["split", "--model", "mobilenet_v2", "--topology", topo], "devices[1].name")
    assert tinyrun.digest(tmp_path) == before  # the workdir was not created, nothing else was written


def test_parts_are_named_inside_their_folder(tmp_path):
    for bad in ("../x", "/abs", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="device name"):
            safeio.child_path(tmp_path, bad, ".npz", "device name")
    assert safeio.child_path(tmp_path, "cam left", ".npz") == os.path.join(tmp_path, "cam left.npz")


def test_duplicate_keys_in_topology_files_are_refused(capsys, tmp_path):
    topo = _topology(tmp_path / "t.yaml", ["ue", "cloud"], dup=True)
    fails(capsys, ["split", "--model", "mobilenet_v2", "--topology", topo], "'links'", "defined twice")
    (tmp_path / "t.json").write_text('{"devices": [{"name": "a", "preset": "raspberry_pi4", "name": "b"}], '
                                     '"links": []}')
    fails(capsys, ["split", "--model", "mobilenet_v2", "--topology", tmp_path / "t.json"], "'name'", "defined twice")
    with pytest.raises(ValueError, match="defined twice"):
        safeio.load_json('{"a": 1, "a": 2}', "x")


def test_an_alias_bomb_in_a_topology_file_is_one_short_line(capsys, tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\ndevices: *a9\nlinks: *a9\n")
    err = fails(capsys, ["split", "--model", "mobilenet_v2", "--topology", tmp_path / "bomb.yaml"])
    assert len(err) < 600


# ----------------------------------------------------------------------------------- numbers and flags

@pytest.mark.parametrize("argv, needles", [
    (["finetune", "DIR", "--batch", "0"], ["--batch", "0"]),  # segfaulted
    (["load", "DIR", "--parallel", "0"], ["--parallel"]),
    (["pipeline", "--workdir", "DIR", "--base-port", "70000"], ["--base-port", "70000"]),  # OverflowError
    (["pipeline", "--workdir", "DIR", "--timeout", "inf"], ["--timeout", "inf"]),
    (["pipeline", "--workdir", "DIR", "--bandwidth-scale", "nan"], ["--bandwidth-scale"]),
    (["export", "--workdir", "DIR", "--batch", "-1"], ["--batch", "-1"]),
    (["split", "--model", "mobilenet_v2", "--topology", "chain", "--bandwidth", "nan"], ["--bandwidth", "nan"]),
    (["autosplit", "--model", "resnet50", "--topology", "chain", "--memory-mb", "-8", "--max-accuracy-drop", "0"],
     ["--memory-mb", "-8"]),
    (["latency", "--table", "t", "--arch", "a", "--resolution", "0"], ["--resolution"]),
    (["search", "--workdir", "DIR", "--num-processes", "99999"], ["--num-processes"]),
    (["search", "--workdir"], ["--workdir"]),  # argparse's own refusal: one line, no usage block
    (["profile"], ["--out"]),
])
def test_out_of_range_flags_are_one_line_naming_the_flag(capsys, tmp_path, argv, needles):
    argv = [str(tmp_path / "d") if a == "DIR" else a for a in argv]
    fails(capsys, argv, *needles)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("override, needles", [
    ("--config.layers_per_device=[1000, 1, 1, 1]", ["1003 layers"]),  # std::bad_alloc
    ("--config.space.head_channels=100000000", ["head_channels=100000000", "GiB"]),
    ("--config.search.penalty=quadratic", ["search.penalty", "quadratic"]),  # refused after three steps
    ("--config.dw_impl=fast", ["dw_impl", "fast"]),
])
def test_settings_that_fail_late_are_refused_before_the_workdir(capsys, tmp_path, override, needles):
    fails(capsys, ["search", "--workdir", tmp_path / "w", override], *needles)
    assert not (tmp_path / "w").exists()


def test_a_population_beyond_memory_is_refused_before_the_workdir(capsys, tmp_path):
    fails(capsys, ["evolve", "--workdir", tmp_path / "w", "--config.evolve.population=2000000000"],
          "evolve.population=2000000000", "GiB")
    assert not (tmp_path / "w").exists()


def test_a_config_argument_typo_is_refused(capsys, tmp_path):
    cfg = os.path.join(REPO, "experiments", "configs", "splitnets_single.py")
    fails(capsys, ["evolve", "--config", f"{cfg}:tyni", "--workdir", tmp_path / "w"], "'tyni'")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("where", ["import", "get_config"])
def test_a_config_file_that_calls_sys_exit_is_a_failing_user_file(capsys, tmp_path, where):
    """sys.exit(0) in a config file (at import or in get_config) made the command exit 0 having done nothing."""
    cfg = tmp_path / "cfg.py"
    body = "import sys\nsys.exit(0)\n" if where == "import" else "import sys\ndef get_config():\n    sys.exit(0)\n"
    cfg.write_text(body)
    fails(capsys, ["search", "--config", str(cfg), "--workdir", tmp_path / "w"], "called sys.exit(0)")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("where", ["import", "factory"])
def test_a_model_module_that_calls_sys_exit_is_a_failing_user_file(capsys, tmp_path, where):
    """sys.exit(0) in a --model module (at import or in its factory): one line, exit 2, nothing written."""
    mod = tmp_path / "m.py"
    mod.write_text("import sys\nsys.exit(0)\ndef f():\n    pass\n" if where == "import" else
                   "import sys\ndef f():\n    sys.exit(0)\n")
    fails(capsys, ["export", "--model", f"{mod}:f", "--topology", "chain", "--workdir", tmp_path / "w"],
          "SystemExit: 0")
    assert not (tmp_path / "w").exists()


FBNET = os.path.join(REPO, "experiments", "configs", "fbnet_raspi4.py")


@pytest.mark.parametrize("override, needles", [
    ("--config.fbnet.supernet_epochs=0", ("fbnet.supernet_epochs=0", "fbnet.fitness=flops")),
    ("--config.fbnet.width=1e-9", ("fbnet.width",)),
])
def test_an_fbnet_search_at_chance_level_is_refused_before_the_workdir(capsys, tmp_path, override, needles):
    """fitness=supernet with an untrained supernet, or a width that makes every layer 2 channels: the search would
    rank networks at chance level and write that as a result."""
    fails(capsys, ["search", "--config", FBNET, "--workdir", tmp_path / "w", override], *needles)
    assert not (tmp_path / "w").exists()


def test_tensorboard_false_is_taken_by_the_fbnet_config():
    """--config.tensorboard=False (docs/runs.md, every training command) on a config file that does not name it."""
    from jmsnas import configs, tensorboard as tb
    from jmsnas.fbnet import flow
    cfg = configs.apply_overrides(configs.load_config(FBNET), ["--config.tensorboard=False"])
    assert tb.enabled(flow.settings(cfg)) is False
    assert tb.enabled(flow.settings(configs.load_config(FBNET))) is True
    with pytest.raises(ValueError, match="config key 'tensorboard': expected true or false"):
        configs.apply_overrides(configs.load_config(FBNET), ["--config.tensorboard=maybe"])


def test_a_killed_splitnets_run_is_told_to_resume(capsys, tmp_path):  # SplitNets resumes (jmsnas.run)
    w = tmp_path / "w"
    w.mkdir()
    (w / "config.json").write_text("{}")
    cfg = os.path.join(REPO, "experiments", "configs", "splitnets_single.py")
    fails(capsys, ["evolve", "--config", f"{cfg}:tiny", "--workdir", w], "pass --resume", "another workdir")


# ----------------------------------------------------------------------------------- paths

@pytest.mark.slow
def test_export_out_inside_a_runs_own_files_is_refused(capsys, run, tmp_path):
    before = tinyrun.digest(run)
    for out in (os.path.join(run, "parts"), os.path.join(run, "parts", "sub"), os.path.join(run, "checkpoints", "x"),
                run):
        fails(capsys, ["export", "--workdir", run, "--out", out], "--out", "nothing was written")
    other = tmp_path / "stuff"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    fails(capsys, ["export", "--workdir", run, "--out", other], "not an earlier export")
    assert tinyrun.digest(run) == before and (other / "mine.txt").read_text() == "keep"


def test_relative_and_absolute_directories_behave_the_same(capsys, run, tmp_path, monkeypatch):
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"overhead_ms": 15.0, "per_array_ms": 0.3, "ms_per_mb": 6.0, "rmse_ms": 0.0,
                              "samples": []}))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["modularize", "--model", run, "--children", "2", "--out", "kids", "--load-model", "lm.json",
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["load", "kids", "--json"]) == 0  # orbax needs absolute paths: they were "corrupt" before
    assert json.loads(capsys.readouterr().out)["children"] == 2
    assert cli.main(["finetune", "kids", "--steps", "1", "--batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["child_dir"] == "child_01.ft1"
    assert cli.main(["load", str(tmp_path / "kids")]) == 0


def test_pipeline_on_a_run_without_result_json_is_one_line(capsys, run, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(run, w)
    os.remove(w / "result.json")
    fails(capsys, ["pipeline", "--workdir", w, "--images", "2"], "result.json", "missing")


# ----------------------------------------------------------------------------------- damaged inputs

def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def test_a_truncated_parts_file_is_one_line(capsys, run, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(run, w)
    _truncate(w / "parts" / "ue.npz")
    for argv in (["autosplit", "--model", w, "--topology", "chain", "--memory-mb", "8", "--max-accuracy-drop", "0.01"],
                 ["modularize", "--model", w, "--children", "2", "--out", tmp_path / "kids"],
                 ["export", "--workdir", w]):
        fails(capsys, argv, "ue.npz", "damaged")
    assert not (tmp_path / "kids").exists() and not (w / "export").exists()


def test_a_cluster_topology_in_autosplit_is_one_line(capsys):
    topo = os.path.join(REPO, "experiments", "topologies", "pi_cluster4.yaml")
    fails(capsys, ["autosplit", "--model", "resnet50", "--topology", topo, "--memory-mb", "8",
                   "--max-accuracy-drop", "0.01"], "cluster")


DAMAGED_CHILD = textwrap.dedent("""
    import json, os, sys
    from jmsnas import cli
    out, lm, model = sys.argv[1], sys.argv[2], sys.argv[3]
    assert cli.main(["modularize", "--model", model, "--children", "2", "--out", out, "--load-model", lm,
                     "--no-progress"]) == 0
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(out, "child_01")) for f in fs]
    big = max(files, key=os.path.getsize)
    os.truncate(big, 0)
    sys.stdout.flush()
    sys.exit(cli.main(["load", out, "--no-progress"]))
""")


@pytest.mark.slow
def test_a_damaged_child_is_one_line_without_event_loop_noise(run, tmp_path):
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"overhead_ms": 15.0, "per_array_ms": 0.3, "ms_per_mb": 6.0, "rmse_ms": 0.0,
                              "samples": []}))
    p = subprocess.run([sys.executable, "-c", DAMAGED_CHILD, str(tmp_path / "kids"), str(lm), run], env=ENV,
                       capture_output=True, text=True, timeout=300)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert "child 1" in err and "changed since it was saved" in err, err


# ----------------------------------------------------------------------------------- a full disk

def _enospc_after(n_bytes):
    """np.savez that writes ``n_bytes`` of the file, then fails as a full disk does."""
    def savez(file, *args, **kwargs):
        with open(file, "wb") as f:
            f.write(b"\0" * n_bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
    return savez


def _leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith((".tmp", ".old")) or ".tmp-" in n]


def test_a_full_disk_in_export_leaves_nothing(capsys, run, tmp_path, monkeypatch):
    monkeypatch.setattr(np, "savez", _enospc_after(100))
    out = tmp_path / "exp"
    fails(capsys, ["export", "--workdir", run, "--out", out], "disk is full", "nothing partial")
    assert os.listdir(tmp_path) == [] and not os.path.exists(os.path.join(run, "export"))


@pytest.mark.slow
def test_a_full_disk_in_autosplit_write_parts_leaves_nothing(capsys, run, tmp_path, monkeypatch):
    monkeypatch.setattr(np, "savez", _enospc_after(100))
    fails(capsys, ["autosplit", "--model", run, "--topology", "chain", "--memory-mb", "8", "--max-accuracy-drop",
                   "0.01", "--write-parts", tmp_path / "parts"], "disk is full")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_in_modularize_leaves_nothing(capsys, tmp_path, monkeypatch):
    from jmsnas.modular import store
    written = []

    def write_child(path, tree, meta):
        os.makedirs(path)
        (open(os.path.join(path, "half"), "wb")).close()
        written.append(path)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(store, "write_child", write_child)
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"overhead_ms": 15.0, "per_array_ms": 0.3, "ms_per_mb": 6.0, "rmse_ms": 0.0,
                              "samples": []}))
    fails(capsys, ["modularize", "--model", "mobilenet_v2", "--children", "3", "--out", tmp_path / "kids",
                   "--load-model", lm, "--no-progress"], "disk is full")
    assert sorted(os.listdir(tmp_path)) == ["lm.json"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    d = tmp_path / "disk"
    d.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                                                       capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_really_full_disk_in_export_leaves_nothing(capsys, run, tiny_disk):
    (tiny_disk / "filler").write_bytes(b"\0" * (200 << 10))  # ~50 KiB left: less than one exported part
    fails(capsys, ["export", "--workdir", run, "--out", tiny_disk / "exp"], "disk is full")
    assert os.listdir(tiny_disk) == ["filler"]


def test_atomic_dir_keeps_the_previous_folder_on_failure(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "old").write_text("old")
    with pytest.raises(OSError):
        with safeio.atomic_dir(d) as tmp:
            open(os.path.join(tmp, "new"), "w").close()
            raise OSError(errno.ENOSPC, "full")
    assert os.listdir(d) == ["old"] and os.listdir(tmp_path) == ["out"]
    with safeio.atomic_dir(d) as tmp:
        open(os.path.join(tmp, "new"), "w").close()
    assert os.listdir(d) == ["new"] and os.listdir(tmp_path) == ["out"]


# ----------------------------------------------------------------------------------- one writer per workdir

HOLD = textwrap.dedent("""
    import sys, time
    from jmsnas.run import workdir
    workdir.lock_workdir(sys.argv[1], "search")
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
def test_a_second_command_on_a_busy_workdir_is_refused_naming_the_first(capsys, tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(w)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tinyrun.digest(w)
        for argv in (["retrain", "--workdir", w], ["search", "--resume", "--workdir", w],
                     ["evolve", "--workdir", w]):
            fails(capsys, argv, "in use by `jmsnas search`", f"process {holder.pid}")
        assert tinyrun.digest(w) == before
    finally:
        holder.kill()
        holder.wait()
    W.check_not_busy(str(w))  # the lock died with its process


PROBE = textwrap.dedent("""
    import sys, time
    import filelock
    lock = filelock.FileLock(sys.argv[1], timeout=10)
    print("ready", flush=True)
    for _ in range(400):  # probes as fast as it can, as the peer processes of a multi-process run do at start
        with lock:
            pass
""")


def test_a_peer_probing_the_lock_at_the_same_moment_is_not_a_busy_workdir(tmp_path):
    """The processes of one multi-process run all check the workdir at once: one's probe of the lock must not make
    another refuse the run as busy (a resumed two-process run once ended with exit 2 this way)."""
    w = tmp_path / "w"
    w.mkdir()
    (w / W.LOCK_FILE).touch()
    prober = subprocess.Popen([sys.executable, "-c", PROBE, str(w / W.LOCK_FILE)], env=ENV, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert prober.stdout.readline().strip() == "ready"
        while prober.poll() is None:
            W.check_not_busy(str(w))
    finally:
        prober.kill()
        prober.wait()


# ----------------------------------------------------------------------------------- several processes

@pytest.mark.parametrize("case", ["alone 1", "alone 0", "busy port"])
def test_multiprocess_start_up_failures_are_one_line(capsys, tmp_path, monkeypatch, case):
    """Before JAX's runtime starts (in-process: the rendezvous needs no JAX): a peer without process 0, process 0
    without its peer, a busy --coordinator port."""
    monkeypatch.setenv("JMSNAS_JOIN_TIMEOUT_S", "2")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1] if case == "busy port" else procs.free_port()
    pid = "1" if case == "alone 1" else "0"
    needle = {"alone 1": "nobody answered", "alone 0": "did not join within 2 s", "busy port": "cannot listen"}[case]
    try:
        fails(capsys, ["search", "--workdir", tmp_path / "w", "--coordinator", f"127.0.0.1:{port}",
                       "--num-processes", "2", "--process-id", pid], needle)
    finally:
        busy.close()
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_processes_given_other_configurations_each_end_with_one_line(tmp_path):
    """Two real processes (no C++ abort, no hang): the configuration fingerprints differ at the join."""
    env = dict(ENV, JMSNAS_JOIN_TIMEOUT_S="60")
    port = procs.free_port()
    group = [subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "search", "--workdir", str(tmp_path / "w"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                               str(i), f"--config.seed={i}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        for p in group:
            _, err = p.communicate(timeout=120)
            err = err.strip()
            assert p.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
            assert "another configuration" in err, err
    finally:
        for p in group:
            if p.poll() is None:
                p.kill()
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------- a damaged latest checkpoint

@pytest.mark.slow
def test_a_damaged_latest_checkpoint_names_the_older_intact_one(tmp_path):
    d = str(tmp_path / "ck")
    state = {"w": np.arange(4096, dtype=np.float32)}
    with Checkpointer(d) as c:
        c.save(3, state, {"epoch": 1})
        c.save(7, {"w": state["w"] + 1}, {"epoch": 2})
    big = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "7")) for f in fs), key=os.path.getsize)
    _truncate(big)
    with Checkpointer(d) as c, pytest.raises(CheckpointError) as info:
        c.restore(state)
    msg = str(info.value)
    assert "step 3 is intact" in msg and "--resume" in msg and "\n" not in msg
    cmd = msg[msg.index("`mv ") + 1: msg.index("`", msg.index("`mv ") + 1)].split()
    os.rename(cmd[1], cmd[2])  # what the message says to do
    with Checkpointer(d) as c:
        got, meta = c.restore(state)
    assert meta["epoch"] == 1 and np.array_equal(got["w"], state["w"])


def test_json_depth_counts_brackets_outside_strings_only():
    assert safeio.load_json('{"a": "[[[[\\"{{{"}', "x", max_depth=1) == {"a": '[[[["{{{'}
    with pytest.raises(ValueError, match="nested more than 2"):
        safeio.load_json('[[["x"]]]', "x", max_depth=2)
    assert safeio.load_json('[["x"]]', "x", max_depth=2) == [["x"]]


# ----------------------------------------------------------------------------------- a refused resume

def _refused_resume_workdir(w, command, cfg, stage):
    """A workdir as a run of ``command`` leaves it (config.json, the lock file) plus a checkpoint of another run
    (its fingerprint differs), so ``--resume`` passes every check of the workdir and is refused at the restore."""
    W.claim_workdir(str(w), False, W.plain(cfg), command)
    W.release_workdirs()
    with Checkpointer(str(w / "checkpoints" / stage)) as c:
        c.save(3, {"w": np.zeros(3, np.float32)}, {"epoch": 0, "batch": 3, "history": [], "fingerprint": "other"})


def test_a_refused_resume_writes_nothing(capsys, tmp_path):
    """The refusal comes once the flow is inside its TensorBoard block (SplitNets here; the main job's case is
    test_pipeline's test_corrupt_checkpoint_is_reported_and_kept): not even an events file is left."""
    from jmsnas import configs
    from jmsnas.splitnets import search as SN
    w, path = tmp_path / "w", os.path.join(REPO, "experiments", "configs", "splitnets_single.py")
    _refused_resume_workdir(w, "evolve", SN.prepare(configs.load_config(f"{path}:tiny"))[0], "supernet")
    before = tinyrun.digest(w)
    fails(capsys, ["evolve", "--config", f"{path}:tiny", "--workdir", w, "--resume"], "checkpoint")
    assert tinyrun.digest(w) == before


def test_a_resumed_claim_removes_the_killed_runs_half_writes_and_nothing_else(tmp_path, tiny_config):
    """A run killed inside atomic_write / atomic_dir leaves ``.<name>.<random>.tmp``; the resumed run, holding the
    workdir's lock, removes those and keeps every finished output."""
    w, cfg = tmp_path / "w", tiny_config
    W.claim_workdir(str(w), False, W.plain(cfg), "search")
    W.release_workdirs()
    (w / "history.json").write_text("{}")
    (w / "parts").mkdir()
    (w / "parts" / "device_0.npz").write_bytes(b"x")
    half = [w / ".result.json.k2j3_x.tmp", w / "parts" / ".manifest.json.a8b.tmp"]
    for p in half:
        p.write_text('{"half')
    (w / ".parts.q1w2.tmp").mkdir()
    (w / ".parts.q1w2.tmp" / "device_0.npz").write_bytes(b"y")
    before = tinyrun.digest(w)
    W.claim_workdir(str(w), True, W.plain(cfg), "search")
    W.release_workdirs()
    after = tinyrun.digest(w)
    assert not [p for p in after if ".tmp" in p]
    assert after == {k: v for k, v in before.items() if ".tmp" not in k and k != W.OWNER_FILE}
