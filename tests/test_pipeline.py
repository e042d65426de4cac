"""The main job end to end: kill/resume, 4 devices vs 1, and bad command lines."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jmsnas import cli
from jmsnas.checkpoint import Checkpointer
from cli_errors import cli_error, refused_writing_nothing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(tmp_path):
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _search(cfg, workdir, env, *extra):
    cmd = [sys.executable, "-m", "jmsnas.cli", "search", "--config", cfg, "--workdir", str(workdir),
           "--no-progress", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_mid_epoch_and_resume_gives_the_same_architecture(tiny_config_file, trained_run, tiny_env, tmp_path):
    # the uninterrupted run: conftest's trained_run, `jmsnas search` of the same tiny config, in the same
    # environment; its compile cache makes the killed run's steps start at once
    env = tiny_env
    expected = json.loads((trained_run / "result.json").read_text())

    run = tmp_path / "killed"
    proc = _search(str(tiny_config_file), run, env)
    ckpt_dir = run / "checkpoints" / "search"
    deadline = time.time() + 900
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        if ckpt_dir.is_dir():
            steps = [int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()]
            if steps:
                killed_at = max(steps)
                proc.send_signal(signal.SIGKILL)
                break
        time.sleep(0.05)
    proc.wait()
    assert killed_at is not None, "the run finished before a checkpoint could be killed"
    meta = json.loads((ckpt_dir / str(killed_at) / "meta" / "metadata").read_text())
    assert meta["batch"] > 0, "the kill should land in the middle of an epoch"
    assert not (run / "result.json").exists()

    resumed = _search(str(tiny_config_file), run, env, "--resume")
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    got = json.loads((run / "result.json").read_text())
    assert got["architecture"] == expected["architecture"]
    assert got["latency_ms"] == expected["latency_ms"]
    assert got["accuracy"] == pytest.approx(expected["accuracy"])
    # the whole run's artefacts are there
    for name in ("history.png", "latency_breakdown.png", "architecture.png", "summary.txt", "parts/manifest.json"):
        assert (run / name).exists(), name


FOUR_DEVICES = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jmsnas import configs, data, pipeline, train, gates as G
    cfg = configs.tiny(configs.default_config())
    cfg.dw_impl = "xla"
    ds = pipeline.load_data(cfg)
    space, table = pipeline.build(cfg, ds)
    mesh = train.data_mesh()
    hp = pipeline._hparams(cfg)
    w, a, _ = train.make_search_steps(space, table, hp, "xla")
    st = train.replicate(train.init_search_state(jax.random.PRNGKey(0), space, hp), mesh)
    losses = []
    for i, (x, y) in enumerate(data.epoch_batches(ds.train, 32, seed=0, epoch=0)):
        st, m = w(st, *train.shard_batch((x, y), mesh))
        st, ma = a(st, *train.shard_batch((x, y), mesh))
        losses.append([float(m["loss"]), float(ma["arch_loss"])])
    print(json.dumps({"devices": jax.device_count(), "losses": losses,
                      "alpha": np.asarray(st.alpha).tolist(),
                      "arch": np.asarray(G.derive(st.alpha, space.mask())).tolist()}))
""")


@pytest.mark.slow
def test_four_cpu_devices_match_one(tmp_path):
    results = {}
    for n in (1, 4):
        env = _env(tmp_path)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # both compile alike, faster: the sharding is what is checked
        out = subprocess.run([sys.executable, "-c", FOUR_DEVICES], env=env, capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0, out.stderr
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results[1]["devices"] == 1 and results[4]["devices"] == 4
    np.testing.assert_allclose(results[4]["losses"], results[1]["losses"], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(results[4]["alpha"], results[1]["alpha"], rtol=1e-3, atol=1e-5)
    assert results[4]["arch"] == results[1]["arch"]


def _tree_digest(path):
    """{file: hash of its bytes}, the workdir's lock file aside (a refused resume takes and releases the lock; a
    workdir made by a run has it already). TensorBoard events count: a refused resume must not start a log."""
    from jmsnas.run.workdir import LOCK_FILE
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f == LOCK_FILE:
                continue
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hash(fh.read())
    return out


@pytest.mark.parametrize("override, needle", [
    ("--config.dataset=mnist_hub", "mnist_hub"),
    ("--config.topology=ring", "ring"),
    ("--config.t_const_ms=0", "t_const_ms"),
    ("--config.t_const_ms=-3", "t_const_ms"),
    ("--config.search.gate_mode=magic", "magic"),
    ("--config.candidate_impl=fastest", "fastest"),
    ("--config.no_such_key=1", "no_such_key"),
])
def test_bad_command_lines_fail_with_one_line(capsys, tmp_path, override, needle):
    assert needle in refused_writing_nothing(capsys, tmp_path, "search", [override])


def test_unwritable_workdir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = cli_error(capsys, ["search", "--workdir", str(blocker / "sub")])
    assert "not writable" in err


def test_existing_run_is_not_overwritten_without_resume(capsys, tmp_path):
    ck = tmp_path / "checkpoints" / "search"
    ck.mkdir(parents=True)
    (ck / "marker").write_text("run")
    before = _tree_digest(tmp_path)
    err = cli_error(capsys, ["search", "--workdir", str(tmp_path)])
    assert "--resume" in err
    assert _tree_digest(tmp_path) == before


@pytest.mark.parametrize("damage", ["mismatched", "garbage"])
def test_corrupt_checkpoint_is_reported_and_kept(capsys, tmp_path, tiny_config_file, damage):
    ckdir = tmp_path / "checkpoints" / "search"
    with Checkpointer(str(ckdir)) as c:
        c.save(3, {"alpha": np.zeros((2, 13), np.float32)}, {"epoch": 0, "batch": 3, "history": [],
                                                             "fingerprint": "x"})
    if damage == "garbage":
        for root, _, files in os.walk(ckdir / "3" / "state"):
            for f in files:
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"\x00garbage")
    before = _tree_digest(tmp_path)
    err = cli_error(capsys, ["search", "--config", str(tiny_config_file), "--workdir", str(tmp_path), "--resume"])
    assert "checkpoint" in err
    assert _tree_digest(tmp_path) == before


def test_resume_without_a_run_is_an_error(capsys, tmp_path):
    err = cli_error(capsys, ["search", "--workdir", str(tmp_path), "--resume"])
    assert "no checkpoint" in err
