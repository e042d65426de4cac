"""The run layer (jmsnas.run) under SplitNets and separable networks: SIGKILL and --resume give the uninterrupted
run's result.json apart from its time; two processes give the one-process result and write each output once; a
kill while writing leaves the previous file or none.

Bounded: every process runs under a timeout and is killed at the end of its test whatever happens."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import procs
import tinyrun
from jmsnas.run import workdir as W

from paths import REPO
SINGLE = os.path.join(REPO, "experiments", "configs", "splitnets_single.py")
SEPARABLE = os.path.join(REPO, "experiments", "configs", "separable.py")
TIMEOUT = procs.TIMEOUT
# SplitNets' tiny config with a checkpoint after every batch, two supernet epochs and three generations of 9, so
# that a kill lands inside each stage (9 rows: 5 and 4 for two processes)
SPLITNETS_FLAGS = ["--config.checkpoint_every=1", "--config.evolve.epochs=2", "--config.evolve.generations=3",
                   "--config.evolve.population=9"]
NAMES = ("result.json", "history.json", "evolution.json", "parts/manifest.json")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    # XLA's optimisation passes off: these tiny runs spend most of their time compiling (every run compared
    # here is started by this fixture)
    environ = procs.env(tmp_path_factory.mktemp("jax_cache"), fast_compile=True)
    started = []

    def run(cmd, config, workdir, *extra, n=1):
        group = procs.start(environ, cmd, config, workdir, *extra, n=n)
        started.extend(group)
        return group

    yield run
    procs.stop(started)


def _kill_when(group, ready):
    """SIGKILL every process of ``group`` as soon as ``ready()``; returns what ``ready()`` returned."""
    deadline, got = time.time() + TIMEOUT, None
    while time.time() < deadline and all(p.poll() is None for p in group):
        got = ready()
        if got:
            break
        time.sleep(0.02)
    for p in group:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return got


def _steps(workdir, stage):
    d = workdir / "checkpoints" / stage
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _meta(workdir, stage, step):
    return json.loads((workdir / "checkpoints" / stage / str(step) / "meta" / "metadata").read_text())


def _outputs(workdir, *names):
    """The run's JSON outputs, result.json without its time (the one entry that varies by run)."""
    out = {n: json.loads((workdir / n).read_text()) for n in names}
    tinyrun.assert_common_top_level(out["result.json"], out["result.json"]["flow"])
    out["result.json"].pop("time")
    return out


def _no_leftovers(workdir):
    left = [f for _, _, fs in os.walk(workdir) for f in fs
            if (f.endswith(".tmp") or f.startswith(".")) and f != W.LOCK_FILE]
    assert not left, left  # every output written once, atomically: no temporary file left


# ------------------------------------------------------------------------------------------------ atomic writes

WRITER = textwrap.dedent("""
    import sys
    from jmsnas.run import directory
    big = ["x" * 64] * 200_000  # ~14 MB of JSON: long enough for a kill to land inside a write
    i = 0
    while True:
        directory.write_json(sys.argv[1], "result.json", {"version": i, "payload": big})
        print(i, flush=True)
        i += 1
""")


def test_a_kill_while_writing_leaves_the_previous_file_or_none(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    seen = set()
    for delay in (0.0, 0.5):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                             text=True)
        try:
            if delay:
                p.stdout.readline()  # at least one version written
                time.sleep(delay)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        path = tmp_path / "result.json"
        if path.exists():  # a whole version, never part of one
            d = json.loads(path.read_text())
            assert len(d["payload"]) == 200_000
            seen.add(d["version"])
        else:
            assert delay == 0.0  # none only before the first write finished
    assert seen  # the file existed after the later kills


# ------------------------------------------------------------------------------------------------ SplitNets

@pytest.fixture(scope="module")
def splitnets_ref(start, tmp_path_factory):
    """The uninterrupted one-process run of the single-view SplitNets config, made once for the module."""
    ref = tmp_path_factory.mktemp("ref")
    procs.finish(start("evolve", SINGLE + ":tiny", ref, *SPLITNETS_FLAGS))
    return ref


@pytest.mark.slow
def test_splitnets_killed_in_supernet_and_evolution_resumes_to_the_same_result(start, splitnets_ref, tmp_path):
    """The single-view config (its reference run serves the two-process test too); the multi-view one checkpoints
    through the same run layer, and its end-to-end runs are tests/splitnets' and tests/deploy's."""
    ref, run = splitnets_ref, tmp_path / "run"
    args = ("evolve", SINGLE + ":tiny")
    # killed mid-epoch in the supernet training
    step = _kill_when(start(*args, run, *SPLITNETS_FLAGS),
                      lambda: [s for s in _steps(run, "supernet") if _meta(run, "supernet", s)["batch"] > 0])
    assert step and not _steps(run, "evolution") and not (run / "result.json").exists()
    # resumed, then killed in the evolution
    gen = _kill_when(start(*args, run, *SPLITNETS_FLAGS, "--resume"), lambda: _steps(run, "evolution"))
    assert gen and max(gen) < 3 and not (run / "result.json").exists()
    procs.finish(start(*args, run, *SPLITNETS_FLAGS, "--resume"))
    assert _outputs(run, *NAMES) == _outputs(ref, *NAMES)
    _no_leftovers(run)


@pytest.mark.slow
def test_splitnets_two_processes_give_the_one_process_result(start, splitnets_ref, tmp_path):
    """Two processes on 127.0.0.1 share each generation's population out (5 and 4 rows) and process 0 writes: from
    the same trained supernet (the one-process run's checkpoint, resumed by two processes) the outputs are the
    one-process outputs exactly, each written once."""
    one, two = splitnets_ref, tmp_path / "two"
    (two / "checkpoints").mkdir(parents=True)
    shutil.copy(one / "config.json", two / "config.json")
    shutil.copytree(one / "checkpoints" / "supernet", two / "checkpoints" / "supernet")
    procs.finish(start("evolve", SINGLE + ":tiny", two, *SPLITNETS_FLAGS, "--resume", n=2))
    assert _outputs(two, *NAMES) == _outputs(one, *NAMES)
    _no_leftovers(two)
    assert sorted(os.listdir(two / "parts")) == ["aggregator.npz", "manifest.json", "sensor.npz"]


# ------------------------------------------------------------------------------------------------ separable

@pytest.mark.slow
def test_separable_killed_between_rounds_resumes_to_the_same_result(start, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = ("separable", SEPARABLE + ":g4a2k3f16:tiny")  # two rounds
    procs.finish(start(*args, ref))
    rounds = _kill_when(start(*args, run), lambda: _steps(run, "separable"))
    assert rounds and max(rounds) < 2 and not (run / "result.json").exists()
    procs.finish(start(*args, run, "--resume"))
    assert _outputs(run, "result.json", "history.json") == _outputs(ref, "result.json", "history.json")
    _no_leftovers(run)
