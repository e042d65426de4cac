"""Tests of jmsnas.checkpoint: round trips, retention, crash safety, and clear errors that leave files intact."""
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.checkpoint import Checkpointer, CheckpointError, leaf_specs


class _State(NamedTuple):
    params: dict
    opt: tuple
    key: jax.Array
    step: jax.Array


def _state(scale=1.0):
    params = {"conv": {"w": jnp.arange(12.0).reshape(3, 4) * scale, "b": jnp.zeros(4)},
              "alpha": [jnp.full((2, 13), 0.5 * scale), jnp.ones((1, 13))]}
    opt = ({"count": jnp.array(7, jnp.int32), "mu": jax.tree.map(jnp.ones_like, params)}, ())
    key = jax.random.key_data(jax.random.PRNGKey(42))
    return _State(params, opt, key, jnp.array(3, jnp.int32))


def _tree_hash(directory):
    """sha256 of every file's relative path and bytes under ``directory``."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(directory)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.fixture
def saved(tmp_path):
    """A directory with steps 1 and 2 saved; yields (directory, state of step 2)."""
    d = str(tmp_path / "ckpt")
    with Checkpointer(d) as ck:
        ck.save(1, _state(1.0), {"epoch": 0, "space": "chain-a"})
        ck.save(2, _state(2.0), {"epoch": 1, "space": "chain-a"})
    return d, _state(2.0)


@pytest.mark.slow
def test_round_trip_nested_tree_and_meta(tmp_path):
    state = _state(1.5)
    meta = {"epoch": 4, "position": 128, "fingerprint": "abc", "lr": 0.002, "nested": {"xs": [1, 2]}}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(10, state, meta)
        template = jax.tree.map(jnp.zeros_like, state)
        got, got_meta = ck.restore(template)
    assert got_meta == meta
    assert isinstance(got, _State)
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got.key.dtype == jnp.uint32
    # the restored key data rebuilds the same PRNG stream
    np.testing.assert_array_equal(jax.random.uniform(jax.random.wrap_key_data(got.key), (3,)),
                                  jax.random.uniform(jax.random.PRNGKey(42), (3,)))


@pytest.mark.slow
def test_numpy_leaves_restore_as_numpy(tmp_path):
    state = {"k": np.array([1, 2], np.uint32), "n": np.arange(3, dtype=np.int64)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(0, state, {})
        got, meta = ck.restore(state)
    assert meta == {}
    assert isinstance(got["k"], np.ndarray) and got["k"].dtype == np.uint32
    np.testing.assert_array_equal(got["n"], state["n"])


@pytest.mark.slow
def test_latest_step_and_max_to_keep(tmp_path):
    d = str(tmp_path / "c")
    with Checkpointer(d, max_to_keep=2) as ck:
        assert ck.latest_step() is None
        for step in (5, 10, 15, 20):
            ck.save(step, _state(float(step)), {"epoch": step})
            assert ck.latest_step() == step
        assert ck.all_steps() == [15, 20]
        _, meta = ck.restore(_state(), step=15)
        assert meta == {"epoch": 15}
    assert sorted(n for n in os.listdir(d) if n.isdigit()) == ["15", "20"]
    with Checkpointer(d, max_to_keep=3) as ck:  # a fresh process sees the same steps
        assert ck.latest_step() == 20
        got, _ = ck.restore(_state())
        np.testing.assert_array_equal(got.params["conv"]["w"], _state(20.0).params["conv"]["w"])


def test_existing_step_is_never_overwritten(saved):
    d, _ = saved
    before = _tree_hash(d)
    with Checkpointer(d) as ck:
        with pytest.raises(CheckpointError, match="step 2 already exists"):
            ck.save(2, _state(9.0), {"epoch": 9})
    assert _tree_hash(d) == before


def test_no_checkpoint_and_unknown_step(tmp_path, saved):
    with Checkpointer(str(tmp_path / "empty")) as ck:
        with pytest.raises(CheckpointError, match="no checkpoint found"):
            ck.restore(_state())
    with Checkpointer(saved[0]) as ck:
        with pytest.raises(CheckpointError, match=r"step 7 not found.*\[1, 2\]"):
            ck.restore(_state(), step=7)


def _state_files(d, step):
    return [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, str(step), "state")) for f in fs]


def _garbage_arrays(d):
    # the step's array bytes live in state/d/<hash> (the per-process ocdbt files are merged there)
    for f in _state_files(d, 2):
        if os.sep + "state" + os.sep + "d" + os.sep in f:
            with open(f, "wb") as fh:
                fh.write(b"not an array" * 5)


def _truncate(rel):
    def corrupt(d):
        with open(os.path.join(d, "2", rel), "r+b") as fh:
            fh.truncate(7)
    return corrupt


def _delete(rel):
    return lambda d: os.remove(os.path.join(d, "2", rel))


# tensorstore's reads of the garbage data fail inside orbax's event loop, which reports an "Event loop is
# closed" on teardown; the error the caller sees is the CheckpointError checked below.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", [_garbage_arrays, _truncate("state/_METADATA"), _delete("state/_METADATA"),
                                     _truncate("meta/metadata"), _delete("meta/metadata")],
                         ids=["garbage-arrays", "truncated-array-metadata", "deleted-array-metadata",
                              "truncated-meta", "deleted-meta"])
def test_corrupt_checkpoint_is_reported_and_left_intact(saved, corrupt):
    d, state = saved
    corrupt(d)
    before = _tree_hash(d)
    with Checkpointer(d) as ck:
        with pytest.raises(CheckpointError, match="is corrupt or unreadable") as info:
            ck.restore(state)
        assert "\n" not in str(info.value)
        assert os.path.join(d, "2") in str(info.value)
        # the older good step is still readable
        _, meta = ck.restore(state, step=1)
        assert meta["epoch"] == 0
    assert _tree_hash(d) == before


@pytest.mark.slow
def test_shape_mismatch_names_leaf_and_shapes(saved):
    d, state = saved
    params = dict(state.params, alpha=[jnp.zeros((3, 13)), jnp.ones((1, 13))])
    before = _tree_hash(d)
    with Checkpointer(d) as ck:
        with pytest.raises(CheckpointError,
                           match=r"leaf 'params/alpha/0' has shape \(2, 13\) in the checkpoint, expected \(3, 13\)"):
            ck.restore(state._replace(params=params))
    assert _tree_hash(d) == before


@pytest.mark.slow
def test_dtype_and_structure_mismatch(saved):
    d, state = saved
    with Checkpointer(d) as ck:
        with pytest.raises(CheckpointError, match=r"leaf 'step' has dtype int32 in the checkpoint, expected float32"):
            ck.restore(state._replace(step=jnp.array(3.0)))
        extra = dict(state.params, extra=jnp.zeros(2))
        with pytest.raises(CheckpointError, match=r"missing leaves \['params/extra'\]"):
            ck.restore(state._replace(params=extra))
        fewer = {"conv": state.params["conv"], "alpha": state.params["alpha"][:1]}
        with pytest.raises(CheckpointError, match=r"unexpected leaves \['params/alpha/1'\]"):
            ck.restore(state._replace(params=fewer))


@pytest.mark.slow
def test_meta_mismatch_names_key(saved):
    d, state = saved
    before = _tree_hash(d)
    with Checkpointer(d) as ck:
        with pytest.raises(CheckpointError, match=r"meta 'space' differs: saved 'chain-a', expected 'mesh-b'"):
            ck.restore(state, expect_meta={"space": "mesh-b"})
        with pytest.raises(CheckpointError, match=r"meta key 'seed' is missing"):
            ck.restore(state, expect_meta={"seed": 1})
        _, meta = ck.restore(state, expect_meta={"space": "chain-a", "epoch": 1})
        assert meta == {"epoch": 1, "space": "chain-a"}
    assert _tree_hash(d) == before


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        Checkpointer(str(blocker))
    with pytest.raises(CheckpointError, match="is not writable"):
        Checkpointer(str(blocker / "sub"))
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(CheckpointError, match="is not writable"):
                Checkpointer(str(ro))
        finally:
            ro.chmod(0o700)


def test_bad_arguments_raise_before_writing(tmp_path):
    d = tmp_path / "c"
    with pytest.raises(ValueError, match="max_to_keep must be an int >= 2"):
        Checkpointer(str(d), max_to_keep=1)
    with Checkpointer(str(d)) as ck:
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            ck.save(-1, _state(), {})
        with pytest.raises(ValueError, match="leaf 'step' is of type int, expected an array"):
            ck.save(0, _state()._replace(step=3), {})
        with pytest.raises(ValueError, match="typed PRNG key"):
            ck.save(0, _state()._replace(key=jax.random.key(0)), {})
        with pytest.raises(ValueError, match="not JSON-serialisable"):
            ck.save(0, _state(), {"x": object()})
        assert ck.latest_step() is None
    assert [n for n in os.listdir(d) if not n.startswith(".")] == []


def test_leaf_specs_paths():
    specs = leaf_specs(_State({"a": jnp.zeros((2, 3))}, ([jnp.zeros(1, jnp.int32)],), jnp.zeros(2, jnp.uint32),
                              jax.ShapeDtypeStruct((), jnp.int32)))
    assert specs == {"params/a": ((2, 3), "float32"), "opt/0/0": ((1,), "int32"),
                     "key": ((2,), "uint32"), "step": ((), "int32")}


_KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from orbax.checkpoint._src.path import atomicity
    from jmsnas.checkpoint import Checkpointer
    ck = Checkpointer(sys.argv[1])
    ck.save(1, {"w": np.full((4, 4), 1.0, np.float32)}, {"epoch": 1})
    async def die(*args, **kwargs):  # the commit point: every file of step 2 is written, the rename is next
        os.kill(os.getpid(), signal.SIGKILL)
    atomicity.async_path.rename = die
    ck.save(2, {"w": np.full((4, 4), 2.0, np.float32)}, {"epoch": 2})
""")


@pytest.mark.slow
def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    d = str(tmp_path / "c")
    proc = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE, d], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    leftovers = [n for n in os.listdir(d) if "tmp" in n]
    assert leftovers and all(n.startswith("2.") for n in leftovers)  # the unfinished step 2
    template = {"w": np.zeros((4, 4), np.float32)}
    with Checkpointer(d) as ck:
        assert ck.all_steps() == [1]
        state, meta = ck.restore(template)
        assert meta == {"epoch": 1}
        np.testing.assert_array_equal(state["w"], np.full((4, 4), 1.0))
        ck.save(2, {"w": np.full((4, 4), 3.0, np.float32)}, {"epoch": 2})  # the resumed run saves step 2 again
        state, meta = ck.restore(template)
    assert meta == {"epoch": 2}
    np.testing.assert_array_equal(state["w"], np.full((4, 4), 3.0))


def test_epoch_end_checkpoints_follow_the_minimum_interval(tmp_path):
    """run.loop.EpochSaves with a hand-driven clock: the first epoch end saves, later ones only once the interval
    has passed since the last save (a mid-epoch save counts), the stage's last epoch always; 0 saves every epoch."""
    import ml_collections
    from jmsnas.run import loop
    now = [0.0]
    saves = loop.EpochSaves(ml_collections.ConfigDict({"checkpoint_every": 2, "checkpoint_min_interval_s": 30.0}),
                                clock=lambda: now[0])
    ckpt = Checkpointer(str(tmp_path / "a"))
    state = {"w": np.zeros(3, np.float32)}
    done = []
    for step, t, last in [(1, 1.0, False), (2, 20.0, False), (3, 31.5, False), (4, 40.0, False), (5, 45.0, True)]:
        now[0] = t
        done.append(saves.save(ckpt, step, state, {"epoch": step}, last_epoch=last))
    assert done == [True, False, True, False, True]
    now[0] = 70.0
    written = []
    for done_batches in (1, 2, 3, 4):  # a 4-batch epoch: a mid-epoch checkpoint after batch 2 only, at t = 70
        saves.mid_epoch(ckpt, done_batches, 4, lambda b=done_batches: written.append(b) or (6 + b, state, {"b": b}))
    assert written == [2]
    now[0] = 95.0
    assert not saves.save(ckpt, 9, state, {"epoch": 9}, last_epoch=False)
    assert ckpt.all_steps() == [5, 8]  # max_to_keep = 2: the newest two of 1, 3, 5, 8
    every = loop.EpochSaves(ml_collections.ConfigDict({"checkpoint_every": 2, "checkpoint_min_interval_s": 0.0}),
                                clock=lambda: 0.0)
    ckpt0 = Checkpointer(str(tmp_path / "b"))
    assert all(every.save(ckpt0, s, state, {"epoch": s}, last_epoch=False) for s in (1, 2, 3))


def test_failed_sibling_reads_are_dropped_for_good_and_nothing_else():
    """A failed tensorstore read's 'Task exception was never retrieved' can be logged after the restore returned
    (when the garbage collector finalises the task): that record is dropped by a filter installed for good; any
    other asyncio record passes."""
    import logging
    from jmsnas import checkpoint as C
    C._drop_failed_sibling_reads()
    C._drop_failed_sibling_reads()  # idempotent
    lg = logging.getLogger("asyncio")
    assert sum(isinstance(f, C._DropFailedSiblingReads) for f in lg.filters) == 1
    rec = lambda msg: logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)
    sibling = ("Task exception was never retrieved\nfuture: <Task finished name='Task-64' exception=ValueError("
               "'OUT_OF_RANGE: Error reading \"w0/0.0\" in OCDBT database at local file \"ck/1/state/\"')>")
    assert not lg.filter(rec(sibling))
    assert lg.filter(rec("Task exception was never retrieved\nfuture: <Task exception=KeyError('x')>"))
    assert lg.filter(rec("Unclosed client session"))


def test_a_kill_before_the_checksum_file_is_renamed_leaves_nothing_on_the_next_open(saved):
    """The process died after orbax committed step 2, while writing its checksum file: the next open removes the
    half-written temporary file and stores the step's checksums, which then catch a later change."""
    from jmsnas.checkpoint import CHECKSUMS
    d, state = saved
    step = os.path.join(d, "2")
    with open(os.path.join(step, CHECKSUMS), encoding="utf-8") as f:
        stored = f.read()
    os.remove(os.path.join(step, CHECKSUMS))
    with open(os.path.join(step, f".{CHECKSUMS}.k2j3_x.tmp"), "w", encoding="utf-8") as f:  # atomic_write's name
        f.write(stored[: len(stored) // 2])
    with Checkpointer(d) as ck:
        assert not [n for n in os.listdir(step) if n.endswith(".tmp")]
        with open(os.path.join(step, CHECKSUMS), encoding="utf-8") as f:
            assert f.read() == stored
        restored, meta = ck.restore(state)
        assert meta["epoch"] == 1
    _garbage_arrays(d)
    with Checkpointer(d) as ck, pytest.raises(CheckpointError, match="changed since it was saved"):
        ck.restore(state)
