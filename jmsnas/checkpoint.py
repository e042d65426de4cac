"""Checkpoints of the whole search state, stored with orbax-checkpoint.

A checkpoint step holds two items: ``state``, a pytree of arrays (weights, alpha, optimiser states, PRNG key
data as a uint32 array, counters as integer arrays), and ``meta``, a JSON dict (epoch, position in the data, a
fingerprint of the configuration). Layout on disk: ``<directory>/<step>/{state,meta}``.

Safety:

* Saves are synchronous: when :meth:`Checkpointer.save` returns, the step is complete on disk.
* Orbax writes a step into ``<step>.orbax-checkpoint-tmp-<ts>`` and renames it to ``<step>`` only once every
  file is written (atomic rename on a local file system). A process killed during a save leaves at most a
  temporary directory, which is never listed as a step, so the previous good step stays the latest one.
  Old steps are deleted only after the new one is committed; ``max_to_keep >= 2`` always leaves one older
  step next to the newest.
* After the commit, process 0 stores the sha256 of every file of the step in ``jmsnas_checksums.json``
  (written to a temporary name, then renamed). A process killed between the commit and that rename leaves a
  whole step without its checksum file; the next Checkpointer opened on the directory stores it.
* :meth:`Checkpointer.restore` compares the stored tree structure, shapes and dtypes and the expected
  metadata against the caller's template before reading any array, and reports any difference, or a corrupt
  or missing checkpoint, as a one-line :class:`CheckpointError`. Nothing is deleted or written on error.

Multi-host: every process constructs the Checkpointer on the same (shared) directory and calls save/restore
together; orbax writes each process's shards and lets the primary process commit. Restored arrays take the
sharding of the template's ``jax.Array`` leaves (numpy leaves restore as numpy arrays).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import sys
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmsnas import safeio

_STATE = "state"
_META = "meta"
CHECKSUMS = "jmsnas_checksums.json"  # in each step directory: sha256 of every file orbax wrote there


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or does not match what the caller expects."""


class _DropOrbaxNoise(logging.Filter):
    """Drops two log records orbax emits on paths this module handles itself.

    * absl: 'Item "state" was found in the checkpoint, but could not be restored' when only meta is read;
    * asyncio: 'Task exception was never retrieved' from sibling reads of a corrupt checkpoint whose first
      error is already reported as a CheckpointError.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not ("could not be restored" in msg or msg.startswith("Task exception was never retrieved"))


class _DropFailedSiblingReads(logging.Filter):
    """asyncio's 'Task exception was never retrieved' for a failed tensorstore read of a checkpoint (the sibling
    reads of a corrupt one, whose first error this module reports as a CheckpointError). Installed for good at the
    first restore: the failed task is finalised when the garbage collector gets to it, which can be after the read
    has returned; every other asyncio record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Task exception was never retrieved")
                    and any(k in msg for k in ("OCDBT", "tensorstore", "TensorStore", "Error reading")))


def _drop_failed_sibling_reads() -> None:
    lg = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropFailedSiblingReads) for f in lg.filters):
        lg.addFilter(_DropFailedSiblingReads())


@contextlib.contextmanager
def _quiet_orbax():
    """Install :class:`_DropOrbaxNoise` on the absl and asyncio loggers for the duration of the block (and
    :class:`_DropFailedSiblingReads` for good)."""
    _drop_closed_loop_tracebacks()
    _drop_failed_sibling_reads()
    noise = _DropOrbaxNoise()
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        gc.collect()  # finalise failed orbax tasks while the filter is still installed
        for lg in loggers:
            lg.removeFilter(noise)


def _key_name(key) -> str:
    """One path element of a pytree key path as plain text (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_specs(tree) -> dict:
    """Map ``"a/b/0"`` leaf paths to ``(shape, dtype name)`` for a pytree of arrays or ShapeDtypeStructs.

    Named tuples, dicts and sequences all become ``/``-joined names, so a template and the dict-shaped tree
    orbax stores compare equal. Raises ValueError naming the first leaf that is not an array.
    """
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(_key_name(k) for k in path) or "<root>"
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(f"state leaf {name!r} is of type {type(leaf).__name__}, expected an array "
                             "(wrap scalars with np.asarray / jnp.asarray)")
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise ValueError(f"state leaf {name!r} is a typed PRNG key; store jax.random.key_data(key) "
                             "(a uint32 array) instead")
        specs[name] = (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name)
    return specs


def _check_writable(directory: str) -> None:
    """Create ``directory`` if needed and prove a file can be written in it, else raise CheckpointError."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} exists and is not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory!r} is not writable: {exc.strerror or exc}") from None


def _check_meta(meta) -> dict:
    """A JSON round trip of ``meta`` (a dict with string keys), or ValueError."""
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    bad = [k for k in meta if not isinstance(k, str)]
    if bad:
        raise ValueError(f"checkpoint meta keys must be strings, got {bad[0]!r}")
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta is not JSON-serialisable: {exc}") from None


def _compare_specs(saved: dict, expected: dict, where: str) -> None:
    """Raise CheckpointError naming the first leaf whose presence, shape or dtype differs."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing leaves {missing[:3]}")
        if extra:
            parts.append(f"unexpected leaves {extra[:3]}")
        raise CheckpointError(f"{where}: tree structure differs from the template: {'; '.join(parts)}")
    for name in sorted(expected):
        (s_shape, s_dtype), (e_shape, e_dtype) = saved[name], expected[name]
        if s_shape != e_shape:
            raise CheckpointError(f"{where}: leaf {name!r} has shape {s_shape} in the checkpoint, "
                                  f"expected {e_shape}")
        if s_dtype != e_dtype:
            raise CheckpointError(f"{where}: leaf {name!r} has dtype {s_dtype} in the checkpoint, "
                                  f"expected {e_dtype}")


def _compare_meta(saved: dict, expect_meta: dict, where: str) -> None:
    """Raise CheckpointError naming the first key of ``expect_meta`` whose saved value differs."""
    expected = _check_meta(expect_meta)
    for key in sorted(expected):
        if key not in saved:
            raise CheckpointError(f"{where}: meta key {key!r} is missing from the checkpoint, "
                                  f"expected {expected[key]!r}")
        if saved[key] != expected[key]:
            raise CheckpointError(f"{where}: meta {key!r} differs: saved {saved[key]!r}, "
                                  f"expected {expected[key]!r}")


def file_digests(step_dir: str) -> dict:
    """{relative path: sha256 hex} of every file under ``step_dir`` except the checksum file itself."""
    out = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if rel == CHECKSUMS:
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = h.hexdigest()
    return out


def verify_digests(step_dir: str, where: str, stored: dict | None = None) -> None:
    """CheckpointError naming the first file that is missing or whose sha256 differs from the one stored at save
    time (``stored``, default: the step's checksum file; steps saved without one are not checked). Run before
    orbax reads anything, so a damaged file never reaches tensorstore (whose failed reads are noisy)."""
    path = os.path.join(step_dir, CHECKSUMS)
    if stored is None and not os.path.isfile(path):
        return
    try:
        if stored is None:
            with open(path, "r", encoding="utf-8") as f:
                stored = json.load(f)["sha256"]
        now = file_digests(step_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: checksum file unreadable: {safeio.error_line(exc)}") from None
    for rel in sorted(stored):
        if rel not in now:
            raise CheckpointError(f"{where} is corrupt or unreadable: file {rel} is missing (it was saved with "
                                  "the step)")
        if now[rel] != stored[rel]:
            raise CheckpointError(f"{where} is corrupt or unreadable: file {rel} changed since it was saved (sha256 "
                                  f"{now[rel][:12]}..., saved {stored[rel][:12]}...)")


def _drop_closed_loop_tracebacks() -> None:
    """When an orbax read fails, tensorstore completes the sibling reads on an asyncio loop orbax has already
    closed; each completion reports 'RuntimeError: Event loop is closed' through sys.unraisablehook (a bare
    traceback, 5-7 of them around the one-line error). Installed before every read: drops those, and only those."""
    previous = sys.unraisablehook
    if getattr(previous, "_jmsnas_filter", False):
        return

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._jmsnas_filter = True
    sys.unraisablehook = hook


def _check_meta_types(meta: dict, types: dict, where: str) -> None:
    """CheckpointError naming the first meta key that is missing or of the wrong type."""
    for key, kind in types.items():
        v = meta.get(key)
        ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 0) if kind == "count" else isinstance(v, kind)
        if not ok:
            want = "an integer >= 0" if kind == "count" else f"a {kind.__name__}"
            raise CheckpointError(f"{where} is corrupt: meta {key!r} is {short_repr(v)}, expected {want}")


def short_repr(value, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Checkpointer:
    """Save and restore ``(state, meta)`` pairs by integer step under one directory (see module doc)."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        if not isinstance(max_to_keep, int) or max_to_keep < 2:
            raise ValueError(f"max_to_keep must be an int >= 2 (the newest step plus a fallback), "
                             f"got {max_to_keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        _check_writable(self.directory)
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False,
            preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
            cleanup_tmp_directories=False,
            create=False,
        )
        handlers = {_STATE: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()}
        try:
            self._manager = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)
        except Exception as exc:  # orbax reads existing step metadata here
            raise CheckpointError(f"cannot open checkpoints in {self.directory}: {safeio.error_line(exc)}") from None
        if jax.process_index() == 0:
            self._finish_interrupted_saves()

    def all_steps(self) -> list:
        """Committed steps, ascending (temporary directories of unfinished saves are not steps)."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the directory holds none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, meta: dict) -> None:
        """Write ``state`` (pytree of arrays) and ``meta`` (JSON dict) as ``step``; complete when it returns.

        Raises ValueError for a bad step, leaf or meta (before anything is written) and CheckpointError when
        the step already exists (it is never overwritten) or the write fails.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        step = int(step)
        leaf_specs(state)
        meta = _check_meta(meta)
        if step in self.all_steps():
            raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}; "
                                  "refusing to overwrite it")
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)})
        try:
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
            if jax.process_index() == 0:
                self._write_digests(step)
        except Exception as exc:
            raise CheckpointError(f"saving checkpoint step {step} in {self.directory} failed: "
                                  f"{safeio.error_line(exc)}") from None

    def _finish_interrupted_saves(self) -> None:
        """A process killed after orbax committed a step but before its checksum file was in place leaves the step
        without one (and perhaps :func:`safeio.atomic_write`'s half-written temporary file). The commit is orbax's
        atomic rename after every file is written, so the step is whole: drop the temporary file and store the
        step's checksums now."""
        for step in self.all_steps():
            step_dir = os.path.join(self.directory, str(step))
            safeio.remove_partial_writes(step_dir)
            if not os.path.isfile(os.path.join(step_dir, CHECKSUMS)):
                self._write_digests(step)

    def _write_digests(self, step: int) -> None:
        """Store the sha256 of every file of the committed step (atomically), verified by :meth:`restore`."""
        step_dir = os.path.join(self.directory, str(step))
        digests = file_digests(step_dir)
        with safeio.atomic_write(os.path.join(step_dir, CHECKSUMS), encoding="utf-8") as f:
            json.dump({"sha256": digests}, f)

    def restore(self, template, step: int | None = None, *, expect_meta: dict | None = None,
                meta_types: dict | None = None) -> tuple[Any, dict]:
        """Read ``(state, meta)`` of ``step`` (default: the latest), checked against ``template``.

        Args:
          template: pytree with the expected structure, shapes and dtypes (arrays or ShapeDtypeStructs); the
            restored state has the template's container types, and jax.Array leaves its sharding.
          step: which step; None for the latest.
          expect_meta: keys whose saved meta values must equal these (e.g. a config fingerprint).
          meta_types: keys the saved meta must hold, with their type: "count" (an int >= 0), list, dict.
        Raises:
          CheckpointError (one line): no checkpoint, unknown step, corrupt or unreadable files, a tree, shape
            or dtype difference (naming the leaf), or a meta difference (naming the key).
        """
        expected = leaf_specs(template)
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        latest = step is None
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"checkpoint step {step!r} not found in {self.directory}; "
                                  f"available steps: {steps}")
        where = f"checkpoint {os.path.join(self.directory, str(step))}"
        try:
            verify_digests(os.path.join(self.directory, str(step)), where)
            meta = self._read_meta(step, where)
            if expect_meta is not None:
                _compare_meta(meta, expect_meta, where)
            _check_meta_types(meta, meta_types or {}, where)
            _compare_specs(self._read_specs(step, where), expected, where)
            args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(template)})
            try:
                with _quiet_orbax():
                    state = self._manager.restore(step, args=args)[_STATE]
            except Exception as exc:
                raise CheckpointError(f"{where} is corrupt or unreadable: {safeio.error_line(exc)}") from None
        except CheckpointError as e:
            if latest and "corrupt or unreadable" in str(e):
                raise CheckpointError(f"{e}; {self._older_intact(steps[:-1], step)}") from None
            raise
        return state, meta

    def _older_intact(self, older: list, damaged: int) -> str:
        """What to do when the latest step is damaged: name the newest older step whose files match their
        checksums, and how to resume from it (move the damaged step out of the checkpoint folder)."""
        for s in reversed(older):
            d = os.path.join(self.directory, str(s))
            try:
                if not os.path.isfile(os.path.join(d, CHECKSUMS)):
                    continue
                verify_digests(d, f"checkpoint {d}")
            except CheckpointError:
                continue
            bad = os.path.join(self.directory, str(damaged))
            aside = f"{self.directory.rstrip(os.sep)}-damaged-{damaged}"
            return (f"the older checkpoint step {s} is intact: move the damaged one aside (`mv {bad} {aside}`) and "
                    f"rerun with --resume to continue from step {s}")
        return "no older intact checkpoint is left: start the run again in a new workdir"

    def _read_meta(self, step: int, where: str) -> dict:
        try:
            args = ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
            with _quiet_orbax():
                meta = self._manager.restore(step, args=args)[_META]
        except Exception as exc:
            raise CheckpointError(f"{where} is corrupt or unreadable (meta): {safeio.error_line(exc)}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where} is corrupt: meta is a {type(meta).__name__}, expected a dict")
        return meta

    def _read_specs(self, step: int, where: str) -> dict:
        try:
            with _quiet_orbax():
                tree = self._manager.item_metadata(step)[_STATE]
            tree = getattr(tree, "tree", tree)
            if tree is None:
                raise ValueError("no array metadata")
            return leaf_specs(tree)
        except Exception as exc:
            raise CheckpointError(f"{where} is corrupt or unreadable (array metadata): "
                                  f"{safeio.error_line(exc)}") from None

    def close(self) -> None:
        """Wait for pending work and release orbax's resources."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
