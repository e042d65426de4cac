"""Checks a run makes before it touches its workdir, and the workdir's record of the run.

A run (``jmsnas search``, ``retrain``, ``evolve``) validates every setting, loads its data and builds its cost
table, estimates the memory of one training step, and checks the workdir, all before it creates or writes
anything. Only then does :func:`claim_workdir` create the workdir and store ``config.json`` (the command and its
whole configuration), which lets ``jmsnas retrain --workdir DIR`` continue any run without its config file and
lets a resumed run say which setting differs from the stored one.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource

import numpy as np

from jmsnas import safeio

CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it."""


def number(cfg, key: str, *, low=None, high=None, low_open=False, integer=False, optional=False):
    """The value at dotted ``key`` of ``cfg`` (a ConfigDict or dict), checked: a (finite) number, integer if asked,
    within bounds; ConfigError naming ``key`` otherwise."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    v = node
    if v is None and optional:
        return v
    kind = "an integer" if integer else "a finite number"
    ok = not isinstance(v, bool) and isinstance(v, (int, np.integer) if integer else (int, float, np.floating))
    ok = ok and math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v <= high
    if not ok:
        rng = ""
        if low is not None:
            rng = f" {'>' if low_open else '>='} {low:g}"
        if high is not None:
            rng += f"{' and' if rng else ''} <= {high:g}"
        raise ConfigError(f"{key} must be {kind}{rng}, got {safeio.short(v)}")
    return v


def check_values(cfg) -> None:
    """Type and range of every numeric setting of the built-in configs (the rest: pipeline.validate_config)."""
    number(cfg, "seed", low=0, integer=True)
    number(cfg, "val_fraction", low=0, high=1, low_open=True)
    number(cfg, "checkpoint_every", low=1, integer=True)
    if "checkpoint_min_interval_s" in cfg:
        number(cfg, "checkpoint_min_interval_s", low=0)
    number(cfg, "eval_batch_size", low=1, integer=True)
    for key in ("search.weight_lr", "search.arch_lr", "retrain.lr", "search.tau0", "search.tau_min"):
        number(cfg, key, low=0, low_open=True)
    number(cfg, "search.tau_decay", low=0, high=1, low_open=True)
    for key in ("search.lambda1", "search.lambda2"):
        number(cfg, key, low=0)
    number(cfg, "retrain.epochs", low=0, integer=True)
    for key in ("image_size", "max_train"):
        number(cfg, key, low=1, integer=True, optional=True)
    for key in ("space.stem_channels", "space.stem_stride", "space.head_channels"):
        number(cfg, key, low=1, integer=True)
    if not isinstance(cfg.shared_weights, bool):
        raise ConfigError(f"shared_weights must be true or false, got {safeio.short(cfg.shared_weights)}")
    for key in ("layers_per_device", "space.device_channels", "space.device_strides"):
        node = cfg
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        if key == "layers_per_device" and node is None:
            continue
        int_list(node, key)


def int_list(node, key: str):
    """``node`` when it is a non-empty list of positive integers, else ConfigError naming ``key``."""
    if not isinstance(node, (tuple, list)) or not node or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in node):
        raise ConfigError(f"{key} must be a list of positive integers, got {safeio.short(node)}")
    return node


# ------------------------------------------------------------------------------------------ command-line flags

def number_flag(kind=int, low=None, high=None, *, low_open=False):
    """An argparse ``type=``: a finite number (an integer for ``kind=int``) within ``[low, high]`` (``(low, high]``
    with ``low_open``); argparse names the flag in the one-line refusal."""
    import argparse

    def convert(text):
        try:
            v = kind(text)
        except (TypeError, ValueError):
            v = None
        ok = v is not None and math.isfinite(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or v <= high)
        if not ok:
            rng = []
            if low is not None:
                rng.append(f"{'>' if low_open else '>='} {low:g}")
            if high is not None:
                rng.append(f"<= {high:g}")
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a finite number'}"
                                             f"{' ' + ' and '.join(rng) if rng else ''}, got {safeio.short(text)}")
        return v
    convert.__name__ = "integer" if kind is int else "number"
    return convert


def path_flag(text: str) -> str:
    """An argparse ``type=`` for a path: the absolute path (relative and absolute forms behave the same, and
    libraries that want absolute paths, e.g. orbax, get one); empty or NUL-containing text refused."""
    import argparse
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"must be a path, got {safeio.short(text)}")
    return os.path.abspath(os.path.expanduser(text))


def check_out_dir(out: str, flag: str, own: str | None = None) -> None:
    """ConfigError when the output folder ``out`` (given as ``flag``) would write into a run's files: ``out`` or
    one of its ancestors is one of a workdir's run outputs (``RUN/parts``, ``RUN/checkpoints/..``, ...) or ``out``
    is itself a workdir holding a run. ``own`` (the run being read) may hold ``out`` in a folder of its own that
    is no run output (``RUN/export``)."""
    p = os.path.realpath(out)
    if safeio.run_outputs(p):
        raise ConfigError(f"{flag} {out!r} is a workdir holding a run ({', '.join(safeio.run_outputs(p)[:3])}); "
                          "choose a folder of its own (nothing was written)")
    child, parent = p, os.path.dirname(p)
    while parent != child:
        name = os.path.basename(child)
        if (name in safeio.RUN_OUTPUTS or name == "checkpoints") and safeio.run_outputs(parent):
            which = "the run's" if own and os.path.realpath(own) == parent else "a run's"
            raise ConfigError(f"{flag} {out!r} is inside {which} own files ({os.path.join(parent, name)}); writing "
                              "there would overwrite them: choose another folder (nothing was written)")
        child, parent = parent, os.path.dirname(parent)


# ------------------------------------------------------------------------------------------ resources

def memory_limit_bytes() -> tuple[int | None, str]:
    """The memory a run may use: physical memory, or a smaller address-space limit (ulimit -v)."""
    limit, what = None, ""
    try:
        limit, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
    except (AttributeError, OSError, ValueError):
        pass
    try:  # what the kernel can give now (other processes' memory excluded)
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        if limit is None or avail < limit:
            limit, what = avail, "available memory"
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and (limit is None or soft < limit):
        limit, what = soft, "address-space limit (ulimit -v)"
    return limit, what


MAX_LAYERS = 256  # searched layers of one space: every candidate of every layer is one compiled program


def step_memory_bytes(space, batch: int, paths: int) -> int:
    """A lower estimate of the memory of one training step, in bytes (float32).

    Activations per layer: the input, the widest expanded activation and the depthwise output of each computed path
    (kept for the backward pass), times ``paths`` computed candidates; plus the stem's output. Weights: every
    candidate of every layer, the stem and the head (its width ``head_channels``), four times (weights, gradients
    and Adam's two moments). Shapes from ``space``.
    """
    from jmsnas.space import OPS, op_params  # imported here: this module sits below space in the import order
    widest = max(op.expand for op in OPS)
    total = space.image_size ** 2 * (space.in_channels + space.stem_channels) * 2
    for s in space.layers:
        mid = s.in_ch * widest
        total += s.in_hw ** 2 * s.in_ch + paths * (s.in_hw ** 2 * mid + s.out_hw ** 2 * (mid + s.out_ch))
    hw, ch = space.head_in
    total += hw * hw * space.head_channels  # the head's activation
    weights = sum(op_params(op, s) for s in space.layers for op in OPS)
    weights += space.in_channels * space.stem_channels * 9 + ch * space.head_channels
    weights += space.head_channels * space.num_classes
    return int(total) * batch * 4 + int(weights) * 4 * 4


def check_memory(space, batch: int, paths: int, what: str, extra_bytes: int = 0, extra_what: str = "") -> None:
    """ConfigError when one training step's estimated memory (plus ``extra_bytes`` for ``extra_what``) exceeds
    what this process may use, or the space has more than MAX_LAYERS layers."""
    if space.num_layers > MAX_LAYERS:
        raise ConfigError(f"layers_per_device sums to {space.num_layers} layers, more than the {MAX_LAYERS} one "
                          "search compiles (every candidate of every layer is in one program); use fewer layers")
    need = step_memory_bytes(space, batch, paths) + int(extra_bytes)
    limit, source = memory_limit_bytes()
    if limit is not None and need > limit:
        raise ConfigError(f"{what} needs about {need / 2**30:.1f} GiB for one training step (estimate, batch "
                          f"{batch}, {space.num_layers} layers, head_channels={space.head_channels}"
                          f"{extra_what}), more than the {limit / 2**30:.1f} GiB {source}; use a smaller image_size, "
                          "batch_size, layers_per_device or head_channels")


# ------------------------------------------------------------------------------------------ the workdir

def _writable_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (itself included) when it is a writable directory, else None."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return p if os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK) else None


def stored_config(workdir: str) -> dict | None:
    """``{"command", "config"}`` stored in ``workdir``, None when there is none; ConfigError when unreadable."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the run's stored configuration {path!r}: {safeio.clip(e)}") from None
    if not isinstance(d, dict) or not isinstance(d.get("config"), dict) or not isinstance(d.get("command"), str):
        raise ConfigError(f"{path!r} is not a stored run configuration (expected {{'command', 'config'}})")
    return d


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
    same command. ``resumable=False`` (a flow without --resume) never advises --resume.
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
                          f"{os.path.join(workdir, CONFIG_FILE)})")


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


def check_not_busy(workdir: str) -> None:
    """ConfigError naming the other process when a process holds ``workdir``'s lock (changes nothing)."""
    import filelock
    path = os.path.join(workdir, LOCK_FILE)
    if os.path.realpath(workdir) in _HELD or not os.path.isfile(path):
        return
    lock = filelock.FileLock(path, timeout=0)
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
            with safeio.atomic_write(os.path.join(workdir, CONFIG_FILE), encoding="utf-8") as f:
                json.dump({"command": "search" if command == "retrain" else command, "config": config}, f,
                          indent=2, default=str)
    except OSError as e:
        raise ConfigError(f"workdir {workdir!r} is not writable: {e.strerror or e}") from None


def plain(config) -> dict:
    """A ConfigDict (or dict) as JSON-ready nested dicts (tuples become lists)."""
    d = config.to_dict() if hasattr(config, "to_dict") else config
    return json.loads(json.dumps(d, default=str))


def tuples(d):
    """Lists in a stored configuration back to tuples (the built-in configs hold tuples)."""
    if isinstance(d, dict):
        return {k: tuples(v) for k, v in d.items()}
    if isinstance(d, list):
        return tuple(tuples(v) for v in d)
    return d
