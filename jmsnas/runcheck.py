"""Checks a run makes before it touches its workdir: the values of its settings and the memory of one step.

A run (``jmsnas search``, ``retrain``, ``evolve``) validates every setting, loads its data and builds its cost
table, estimates the memory of one training step, and checks the workdir (``jmsnas.run.workdir``), all before it
creates or writes anything. ``ConfigError`` is the one error type of a configuration value that cannot be used;
``with_defaults``, ``number`` and ``check_bounds`` are the vocabulary a flow declares its settings' defaults and
bounds in.
"""
from __future__ import annotations

import math
import os
import resource

import numpy as np

from jmsnas import safeio

class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it."""


def number(cfg, key: str, *, low=None, high=None, low_open=False, high_open=False, integer=False,
           optional=False):
    """The value at dotted ``key`` of ``cfg`` (a ConfigDict or dict), checked: a (finite) number, integer if asked,
    within bounds (``low``/``high`` inclusive unless ``low_open``/``high_open``); ConfigError naming ``key``, the
    bounds and the value otherwise."""
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
        ok = v < high if high_open else v <= high
    if not ok:
        rng = ""
        if low is not None:
            rng = f" {'>' if low_open else '>='} {low:g}"
        if high is not None:
            rng += f"{' and' if rng else ''} {'<' if high_open else '<='} {high:g}"
        raise ConfigError(f"{key} must be {kind}{rng}, got {safeio.short(v)}")
    return v


def check_bounds(cfg, bounds: dict) -> None:
    """Every ``{dotted key: number() keyword arguments}`` of ``bounds`` checked in ``cfg``: how a flow declares the
    bounds of its numeric settings as data."""
    for key, kw in bounds.items():
        number(cfg, key, **kw)


def with_defaults(given, defaults: dict, block: str) -> dict:
    """``{**defaults, **given}`` for a config block (a ConfigDict, dict or None) named ``block``; ConfigError
    naming the keys of ``given`` that are not settings: how a flow declares its settings' defaults as data."""
    given = {} if given is None else given.to_dict() if hasattr(given, "to_dict") else dict(given)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown {block} settings {unknown}; expected some of {sorted(defaults)}")
    return {**defaults, **given}


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
    if "lambda_limits" in cfg.search:
        number(cfg, "search.lambda_limits", low=0)
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
