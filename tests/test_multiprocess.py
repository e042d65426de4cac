"""The search as two processes on 127.0.0.1 (JAX's multi-process runtime, gloo CPU collectives): the same result as
one process, outputs written once, a killed-and-resumed two-process run, and a process killed for good.

Bounded: every process runs under a timeout and is killed at the end of its test whatever happens."""
import json
import os
import shutil
import signal
import subprocess
import textwrap
import time

import pytest

import procs
from jmsnas import distributed
from jmsnas.run import workdir as W

TINY = textwrap.dedent("""
    from jmsnas.configs import default_config, tiny
    def get_config():
        c = tiny(default_config())
        c.dw_impl = "xla"
        c.checkpoint_every = 2
        return c
""")
TIMEOUT = procs.TIMEOUT


@pytest.fixture
def run_env(tmp_path, tiny_env):
    cfg = tmp_path / "tiny.py"
    cfg.write_text(TINY)
    environ = tiny_env  # conftest's trained_run's environment: the compile cache it filled
    started = []

    def start(workdir, *extra, n=1, cmd="search"):
        group = procs.start(environ, cmd, cfg, workdir, *extra, n=n)
        started.extend(group)
        return group

    yield start
    procs.stop(started)


def _result(workdir):
    return json.loads((workdir / "result.json").read_text()), json.loads((workdir / "history.json").read_text())


def _same(a, b):
    (ra, ha), (rb, hb) = a, b
    assert ra["architecture"] == rb["architecture"]
    assert ra["latency_ms"]["total"] == pytest.approx(rb["latency_ms"]["total"], rel=1e-5)
    assert [h["stage"] for h in ha] == [h["stage"] for h in hb]
    for x, y in zip(ha, hb):  # losses to float tolerance; E[T] is a function of alpha, so alpha agrees too
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=2e-3, abs=2e-4)
        if x["expected_latency_ms"] is not None:
            assert x["expected_latency_ms"] == pytest.approx(y["expected_latency_ms"], rel=1e-4)


@pytest.mark.slow
def test_two_processes_give_the_one_process_result_and_resume(run_env, trained_run, tmp_path):
    """One process, then two processes killed after their first checkpoint and resumed: the same losses, E[T]
    (a function of alpha) and architecture (an uninterrupted two-process run is the special case without kill).
    The one-process run is conftest's trained_run: the same tiny config apart from the checkpoint cadence, which
    only decides when a checkpoint is written."""
    one, killed = trained_run, tmp_path / "killed"
    group = run_env(killed, n=2)
    ck = killed / "checkpoints" / "search"
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and all(p.poll() is None for p in group):
        if ck.is_dir() and any(d.name.isdigit() for d in ck.iterdir()):
            break
        time.sleep(0.2)
    for p in group:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not (killed / "result.json").exists()
    procs.finish(run_env(killed, "--resume", n=2))
    _same(_result(killed), _result(one))
    assert json.loads((killed / "config.json").read_text())["command"] == "search"
    leftovers = [f for _, _, fs in os.walk(killed) for f in fs
                 if (f.endswith(".tmp") or f.startswith(".")) and f != W.LOCK_FILE]
    assert not leftovers  # process 0 wrote each output once, atomically; nothing half-written (the lock file stays)


@pytest.mark.slow
def test_a_killed_process_ends_the_other_with_one_line(run_env, tmp_path):
    group = run_env(tmp_path / "w", n=2)
    ck = tmp_path / "w" / "checkpoints" / "search"
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and group[0].poll() is None:
        if ck.is_dir() and any(d.name.isdigit() for d in ck.iterdir()):
            break
        time.sleep(0.2)
    group[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    try:
        out, err = group[0].communicate(timeout=distributed.HEARTBEAT_TIMEOUT_S + 120)
    except subprocess.TimeoutExpired:
        pytest.fail("the surviving process hung after its peer was killed")
    assert group[0].returncode != 0
    assert time.time() - t0 < distributed.HEARTBEAT_TIMEOUT_S + 120
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and "jmsnas search: error:" in lines[-1] and "process" in lines[-1], err[-3000:]


@pytest.mark.slow
def test_evolve_shares_the_population_out_and_gives_the_one_process_result(run_env, evolved_run,
                                                                          evolve_config_file, tmp_path):
    """``jmsnas evolve`` as two processes evaluates each population half and half (9 rows: 5 and 4 plus a repeated
    row) and gathers the fitness. Both runs start the evolution from the same trained supernet (the one-process
    run's checkpoint, resumed by two processes), so the evolution must be the one-process evolution exactly. The
    one-process run is conftest's evolved_run (``jmsnas evolve`` of the same config)."""
    (tmp_path / "tiny.py").write_text(evolve_config_file.read_text())
    one, two = evolved_run, tmp_path / "two"
    (two / "checkpoints").mkdir(parents=True)
    shutil.copy(one / "config.json", two / "config.json")
    shutil.copytree(one / "checkpoints" / "supernet", two / "checkpoints" / "supernet")
    procs.finish(run_env(two, "--resume", n=2, cmd="evolve"))
    ea, eb = (json.loads((w / "evolution.json").read_text()) for w in (one, two))
    assert len(eb["generations"]) == 2 and ea["winner"] == eb["winner"] and ea["best"]["ops"] == eb["best"]["ops"]
    for ga, gb in zip(ea["generations"], eb["generations"], strict=True):  # the whole population's accuracies
        assert ga["mean_accuracy"] == pytest.approx(gb["mean_accuracy"], abs=1e-6)
        assert ga["best_accuracy"] == pytest.approx(gb["best_accuracy"], abs=1e-6)
    ra, rb = (json.loads((w / "result.json").read_text()) for w in (one, two))
    assert ra["architecture"] == rb["architecture"]


@pytest.mark.parametrize("flags, needle", [
    (["--num-processes", "0"], "--num-processes"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "--process-id"),
])
def test_bad_multiprocess_flags(capsys, tmp_path, flags, needle):
    from jmsnas import cli
    assert cli.main(["search", "--workdir", str(tmp_path / "w"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "w").exists()
