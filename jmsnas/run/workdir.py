"""Claiming a workdir: check it, lock it, create it, store the configuration, fingerprint the run.

A run checks everything about its workdir without writing (:func:`check_workdir`), then, once every other check
has passed, :func:`claim` takes the workdir's lock (one writer per workdir), creates it and stores ``config.json``
(the command and its whole configuration), which lets ``jmsnas retrain --workdir DIR`` continue any run without
its config file and lets a resumed run say which setting differs from the stored one. :func:`fingerprint` is the
hash a run's checkpoints carry, so a resumed run cannot silently change what it computes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os

from jmsnas import safeio
from jmsnas.run import directory
from jmsnas.run.directory import stored_config
from jmsnas.runcheck import ConfigError


def _writable_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (itself included) when it is a writable directory, else None."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return p if os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK) else None


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


# how often checkpoints are written, and whether TensorBoard logs are: not what the run computes, so free to change
# on resume and left out of the run's fingerprint
CHECKPOINT_KEYS = ("checkpoint_every", "checkpoint_min_interval_s", "tensorboard")


def config_diff(saved: dict, now: dict) -> list:
    """``key: stored X, now Y`` for every setting that differs (how often checkpoints are written may change on
    resume: ``CHECKPOINT_KEYS``)."""
    a, b = _flat(saved), _flat(now)
    keys = sorted(k for k in set(a) | set(b) if k not in CHECKPOINT_KEYS and a.get(k, "<unset>") != b.get(k, "<unset>"))
    return [f"{k}: stored {safeio.short(a.get(k, '<unset>'), 60)}, now {safeio.short(b.get(k, '<unset>'), 60)}"
            for k in keys]


def check_workdir(workdir: str, resume: bool, config: dict, command: str, resumable: bool = True) -> None:
    """Everything about ``workdir`` that would refuse the run, checked without creating or writing anything.

    A new run needs a workdir that is creatable/writable and holds no run output (checkpoints with files,
    result.json, history.json, summary.txt, plots, parts/, evolution.json, config.json); a resumed one needs
    checkpoints, a stored configuration (when there is one) equal to ``config`` except ``CHECKPOINT_KEYS``, and the
    same command. ``resumable=False`` (a flow without --resume: the FBNet flow) never advises --resume.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"workdir {workdir!r} is not writable: it exists and is not a directory")
    if os.path.isdir(workdir):
        if not os.access(workdir, os.W_OK | os.X_OK):
            raise ConfigError(f"workdir {workdir!r} is not writable: permission denied")
    elif _writable_ancestor(workdir) is None:
        raise ConfigError(f"workdir {workdir!r} is not writable: it cannot be created here")
    check_not_busy(workdir)
    found = safeio.run_outputs(workdir)
    if not resume:
        if found:
            how = "pass --resume to continue it or choose" if resumable else \
                "this flow cannot resume a run (no --resume): choose"
            raise ConfigError(f"workdir {workdir!r} already holds a run ({', '.join(found[:4])}); {how} another "
                              "workdir (nothing was changed)")
        return
    if "checkpoints/" not in found:
        raise ConfigError(f"--resume given but workdir {workdir!r} has no checkpoint")
    stored = stored_config(workdir)
    if stored is None:
        return  # a run made before workdirs stored their config: the checkpoints' fingerprint still guards it
    if stored["command"] != command and not {stored["command"], command} <= {"search", "retrain"}:
        raise ConfigError(f"workdir {workdir!r} holds a `jmsnas {stored['command']}` run; continue it with "
                          f"`jmsnas {stored['command']} --resume`, not `jmsnas {command}`")
    diff = config_diff(stored["config"], config)
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ConfigError(f"the run in {workdir!r} was made with other settings: {'; '.join(diff[:3])}{more}; "
                          f"resume with the stored ones (omit --config and overrides: they are read from "
                          f"{os.path.join(workdir, directory.CONFIG)})")


# ------------------------------------------------------------------------------------------ one writer per workdir

LOCK_FILE = ".jmsnas.lock"  # flock'ed by the process writing the workdir (filelock)
OWNER_FILE = ".jmsnas.owner"  # who holds it: {"command", "pid", "host", "started"} (read by the refused process)
_HELD = {}  # realpath of a workdir -> its held FileLock (released by release_workdirs, or at process exit)


def _owner(workdir: str) -> str:
    try:
        with open(os.path.join(workdir, OWNER_FILE), encoding="utf-8") as f:
            o = json.load(f)
        return f"`jmsnas {o['command']}` (process {o['pid']} on {o['host']}, started {o['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another jmsnas process"


def _busy(workdir: str) -> ConfigError:
    return ConfigError(f"workdir {workdir!r} is in use by {_owner(workdir)}; wait for it to end (or stop it) "
                       "before starting another command on this workdir (nothing was changed)")


# how long a probe waits for the lock before calling the workdir busy: the processes of one multi-process run all
# probe it at the same moment, each holding it for microseconds, while a running command holds it for its whole run
PROBE_WAIT_S = 2.0


def check_not_busy(workdir: str) -> None:
    """ConfigError naming the other process when a process holds ``workdir``'s lock (changes nothing). The lock
    is probed by taking it, waiting up to ``PROBE_WAIT_S`` so that a peer process's probe is not taken for a
    running command."""
    import filelock
    path = os.path.join(workdir, LOCK_FILE)
    if os.path.realpath(workdir) in _HELD or not os.path.isfile(path):
        return
    lock = filelock.FileLock(path, timeout=PROBE_WAIT_S)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _busy(workdir) from None
    except OSError:
        return  # an unwritable workdir: check_workdir names that
    lock.release()


def lock_workdir(workdir: str, command: str) -> None:
    """Hold ``workdir``'s lock for the rest of this command (one writer per workdir: a second ``jmsnas`` command
    on the same workdir is refused with a line naming this one). ConfigError when another process holds it."""
    import datetime
    import socket

    import filelock
    key = os.path.realpath(workdir)
    if key in _HELD:
        return
    lock = filelock.FileLock(os.path.join(workdir, LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _busy(workdir) from None
    _HELD[key] = lock
    with safeio.atomic_write(os.path.join(workdir, OWNER_FILE), encoding="utf-8") as f:
        json.dump({"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                   "started": datetime.datetime.now().isoformat(timespec="seconds")}, f)


def release_workdirs() -> None:
    """Release every workdir lock this process holds (the command ended)."""
    while _HELD:
        key, lock = _HELD.popitem()
        with contextlib.suppress(OSError):
            os.remove(os.path.join(key, OWNER_FILE))
        lock.release()


def claim_workdir(workdir: str, resume: bool, config: dict, command: str) -> None:
    """Create ``workdir``, take its lock (:func:`lock_workdir`) and store the run's configuration there
    (atomically), after :func:`check_workdir`."""
    try:
        os.makedirs(workdir, exist_ok=True)
        lock_workdir(workdir, command)
        if not resume:  # a resumed run keeps what it has (a run older than config.json stays without one)
            directory.write_config(workdir, "search" if command == "retrain" else command, config)
        else:  # the killed run's half-written outputs (never its finished ones) go: this process is the writer
            safeio.remove_partial_writes(workdir)
    except OSError as e:
        raise ConfigError(f"workdir {workdir!r} is not writable: {e.strerror or e}") from None


def plain(config) -> dict:
    """A ConfigDict (or dict) as JSON-ready nested dicts (tuples become lists)."""
    d = config.to_dict() if hasattr(config, "to_dict") else config
    return json.loads(json.dumps(d, default=str))


def fingerprint(cfg, *facts) -> str:
    """A hash of everything that determines the run: the configuration (except ``CHECKPOINT_KEYS``) and ``facts``
    (JSON-ready data the configuration only names, e.g. ``jmsnas.space.to_dict`` of the space a topology file and
    the data's sizes give)."""
    d = plain(cfg)
    for key in CHECKPOINT_KEYS:
        d.pop(key, None)
    blob = json.dumps([d, *facts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def claim(workdir: str, resume: bool, config: dict, command: str) -> None:
    """:func:`claim_workdir` by process 0 once every process has checked the workdir (multi-process runs)."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jmsnas: workdir checked")
    if directory.writes():
        claim_workdir(workdir, resume, config, command)


def check_and_claim(workdir: str, resume: bool, cfg, command: str) -> None:
    """:func:`check_workdir` then :func:`claim`: for flows whose other checks are all done."""
    stored = plain(cfg)
    check_workdir(workdir, resume, stored, command)
    claim(workdir, resume, stored, command)
