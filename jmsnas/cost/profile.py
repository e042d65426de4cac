"""Latency tables measured on the current JAX backend (CPU, GPU or TPU): the harness behind ``jmsnas profile``.

Everything is jitted, at batch ``batch``, with parameters passed as arguments, and timed with
``block_until_ready``. All items of a profile are timed in interleaved rounds: in each of ``reps`` rounds every
item is called once, in a shuffled order, each timed call right after an untimed call of the same function
(steady-state latency, as when a device serves request after request), so that bursts of load from other
processes hit all items alike. The statistic of the ``reps`` samples is the ``quantile`` (the median by default;
a low quantile estimates the undisturbed latency on a busy machine); the spread is the interquartile range.

Always measured: a near-empty jitted call with 0, 8, 32 and 128 extra argument arrays (giving ``call`` and the
cost per array ``arg_ms``), and the stem and the head, each next to a *reference call* (a near-empty jitted
function with the same arguments and output shape): their in-network cost is
``q(call) - q(reference) + arg_ms * (their parameter and state arrays)``.

The ops, by ``method``:

* ``"in-network"`` (default): each op is measured where it runs, inside a network. A base network (``base``,
  by default mbconv_k3_e3 in every slot) and, for every slot and valid op, the base with that one slot changed
  are timed end to end, every network once per round (so all are equally warm; a network timed more often
  runs measurably faster). An op's cost is the base op's cost plus the change of the network's latency. The
  base op's cost is the network's saving when the slot is an identity (slots that keep the shape) or, where
  identity is not allowed, its standalone cost (as below; every network has an op there, so a constant error
  of that anchor is absorbed by the offset). Whatever the base network costs beyond call, stem, head and
  its ops becomes ``network.offset_ms``; then ``calibrate`` random whole networks, timed in the same rounds,
  fit a scale of the op entries and the offset (a sum of one-context changes misses what one jitted call of a
  whole network overlaps and fuses). This captures what standalone kernels cannot see: XLA:CPU runs a
  short kernel sequence (<= 8 kernels, a standalone MBConv) in order on one thread, but a network's longer,
  branching sequence as a dataflow graph on its thread pool, at a different cost per kernel.
* ``"standalone"``: each op is called on its own, next to its reference call, and its cost is computed like the
  stem's; ``calibrate`` random sub-networks measured end to end give ``network.offset_ms`` (the median of
  measured minus modelled latency).

Slots of identical shape share one measurement per op. The file format and the latency model are in
``jmsnas.cost.measured``; ``measure_archs_ms`` times whole sub-networks (``supernet.extract`` +
``compact_apply``, eval mode) the same way.
"""
from __future__ import annotations

import gc
import os
import platform
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas import supernet
from jmsnas.cost.measured import (METHODS, MeasuredTable, ProfileError, Timing, check_space, load_table,  # noqa: F401
                                  op_ms_matrix, predict_arch_ms, slot_shape, space_fingerprint, space_summary,
                                  table_from_dict, write_table)
from jmsnas.space import IDENTITY, OP_NAMES, OPS, SearchSpace

_REF_ELEMS = 1024  # XLA:CPU runs computations under 1000 FLOPs inline; the reference must take the op's path
_ARG_COUNTS = (0, 8, 32, 128)
_BASE_COPIES = 8  # separately compiled copies of the in-network method's base network
_WEIGHTS_KEY = 0  # weight values do not change timings; a fixed key keeps profiles reproducible


def backend_info() -> dict:
    """What the numbers were measured on: JAX backend and device, versions, CPU model and count."""
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"backend": jax.default_backend(), "device_kind": str(dev.device_kind), "num_devices": jax.device_count(),
            "jax": jax.__version__, "cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


# ---------------------------------------------------------------------------------------------- timing


def _check_settings(batch, reps, warmup, quantile, calibrate=0) -> None:
    for name, v, lo in (("batch", batch, 1), ("reps", reps, 3), ("warmup", warmup, 0), ("calibrate", calibrate, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ProfileError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0.0 < quantile < 1.0:
        raise ProfileError(f"quantile must be a number in (0, 1) (0.5 = median), got {quantile!r}")


def _call_ms(fn, args) -> float:
    jax.block_until_ready(fn(*args))  # untimed: the timed call finds caches warm, as in repeated inference
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def time_rounds(groups: Sequence[Sequence[tuple]], reps: int, warmup: int, seed: int = 0) -> list:
    """Times every (jitted fn, args) of every group once per round, groups in a shuffled order per round.

    Each timed call directly follows an untimed call of the same function (steady-state, warm-cache latency,
    as when a network serves request after request). The members of a group run back to back (in reverse
    order on odd rounds), so paired items see the same load. Returns one float64[len(group), reps] array of
    per-call wall-clock ms per group.
    """
    for group in groups:
        for fn, args in group:
            for _ in range(warmup + 1):  # the first call compiles
                jax.block_until_ready(fn(*args))
    rng = np.random.default_rng(seed)
    out = [np.empty((len(g), reps)) for g in groups]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(reps):
            for gi in rng.permutation(len(groups)):
                order = range(len(groups[gi])) if r % 2 == 0 else reversed(range(len(groups[gi])))
                for j in order:
                    out[gi][j, r] = _call_ms(*groups[gi][j])
    finally:
        if was_enabled:
            gc.enable()
    return out


def _timing(samples, quantile: float) -> Timing:
    return Timing(float(np.quantile(samples, quantile)), _iqr(samples), int(len(samples)))


# ------------------------------------------------------------------------------------------ callables


def _reference(out_shape: tuple):
    """A jitted near-empty call with any arguments (all kept) returning zeros of ``out_shape``."""
    def ref(*args):
        s = jnp.sum(jnp.arange(_REF_ELEMS, dtype=jnp.float32) * args[-1].reshape(-1)[0])
        return jnp.zeros(out_shape, jnp.float32) + s
    return jax.jit(ref, keep_unused=True)


def _n_arrays(tree) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def _op_call(key, op, slot, batch: int, dw_impl: str):
    p, st = O.op_init(key, op, slot.in_ch, slot.out_ch)
    x = jnp.ones((batch, slot.in_hw, slot.in_hw, slot.in_ch), jnp.float32)
    fn = jax.jit(lambda p, st, x: O.op_apply(p, st, x, op, slot.stride, False, dw_impl)[0])
    return fn, (p, st, x)


def _stem_call(key, space: SearchSpace, batch: int):
    p, st = O.conv_bn_init(key, 3, space.in_channels, space.stem_channels)
    x = jnp.ones((batch, space.image_size, space.image_size, space.in_channels), jnp.float32)
    return jax.jit(lambda p, st, x: O.conv_bn_apply(p, st, x, space.stem_stride, False)[0]), (p, st, x)


def _head_call(key, space: SearchSpace, batch: int):
    hw, ch = space.head_in
    p, st = O.head_init(key, ch, space.head_channels, space.num_classes)
    x = jnp.ones((batch, hw, hw, ch), jnp.float32)
    return jax.jit(lambda p, st, x: O.head_apply(p, st, x, False)[0]), (p, st, x)


def _paired(call) -> list:
    fn, args = call
    out = jax.eval_shape(fn, *args)
    return [call, (_reference(out.shape), args)]


def arch_calls(space: SearchSpace, archs: Sequence, batch: int, dw_impl: str) -> list:
    """[(jitted fn, args)] of every architecture run whole as one call (the weights as arguments), as the profile
    times networks (``time_rounds``) and ``jmsnas.deploy.partcost`` its load reference."""
    params, state = supernet.init(jax.random.PRNGKey(_WEIGHTS_KEY), space)
    x = jnp.ones((batch, space.image_size, space.image_size, space.in_channels), jnp.float32)
    calls = []
    for ops in archs:
        ops = tuple(int(i) for i in ops)
        cp, cs = supernet.extract(space, params, state, ops)
        fn = jax.jit(lambda p, s, x, ops=ops: supernet.compact_apply(space, ops, p, s, x, train=False,
                                                                    dw_impl=dw_impl)[0])
        calls.append((fn, (cp, cs, x)))
    return calls


def sample_archs(space: SearchSpace, n: int, seed) -> list:
    """``n`` architectures with every slot's op drawn uniformly from its valid candidates (numpy seed)."""
    rng = np.random.default_rng(seed)
    valid = [np.flatnonzero(row) for row in space.mask()]
    return [tuple(int(rng.choice(v)) for v in valid) for _ in range(n)]


# ------------------------------------------------------------------------------------------ measurement


def measure_archs_ms(space: SearchSpace, archs: Sequence, *, batch: int = 1, reps: int = 50, warmup: int = 3,
                     quantile: float = 0.5, seed: int = 0, dw_impl: str = "auto") -> list:
    """End-to-end latency (Timing, ms) of each architecture (op index per slot), timed in interleaved rounds."""
    _check_settings(batch, reps, warmup, quantile)
    for ops in archs:
        space.validate_arch(ops)
    raw = time_rounds([[c] for c in arch_calls(space, archs, batch, dw_impl)], reps, warmup, seed)
    return [_timing(r[0], quantile) for r in raw]


def measure_arch_ms(space: SearchSpace, ops, **kwargs) -> Timing:
    """End-to-end latency of one architecture; keyword arguments as ``measure_archs_ms``."""
    return measure_archs_ms(space, [ops], **kwargs)[0]


def _shape_key(s) -> tuple:
    return (s.in_hw, s.in_ch, s.out_ch, s.stride)


def _representatives(space: SearchSpace) -> dict:
    """Slot index -> the first slot of the same shape (the one that is measured)."""
    first = {}
    return {s.index: first.setdefault(_shape_key(s), s.index) for s in space.layers}


class _Plan:
    """The groups of calls of one profile and where each item's samples land (indices into the groups)."""

    def __init__(self):
        self.groups = []

    def add(self, group: list) -> int:
        self.groups.append(group)
        return len(self.groups) - 1


def _standalone_ops(plan: _Plan, space: SearchSpace, pairs: dict, batch: int, dw_impl: str) -> dict:
    """Adds (op, reference) groups for {(slot, op index)} of representative slots; returns them -> group."""
    key = jax.random.PRNGKey(_WEIGHTS_KEY)
    out = {}
    for n, i in pairs:
        fn_args = _op_call(key, OPS[i], space.layers[n], batch, dw_impl)
        out[(n, i)] = (plan.add(_paired(fn_args)), _n_arrays(fn_args[1][:2]))
    return out


def _valid_ops(space: SearchSpace, n: int) -> list:
    return [int(i) for i in np.flatnonzero(space.mask()[n])]


def _in_network_plan(plan: _Plan, space: SearchSpace, base: tuple, reps_slots: list, batch: int,
                     dw_impl: str) -> tuple:
    """Groups of the base network (``_BASE_COPIES`` separately compiled copies) and of every one-slot variant.

    Every network is timed once per round, so all are equally warm; the copies make the base network's
    latency, which every op's estimate subtracts, ``_BASE_COPIES`` times better sampled without timing any
    one executable more often than the others. Returns (base groups, {(slot, op): group}).
    """
    variants = [(n, i, base[:n] + (i,) + base[n + 1:]) for n in reps_slots for i in _valid_ops(space, n)
                if i != base[n]]
    calls = arch_calls(space, [base] * _BASE_COPIES + [a for _, _, a in variants], batch, dw_impl)
    base_groups = [plan.add([c]) for c in calls[:_BASE_COPIES]]
    return base_groups, {(n, i): plan.add([c]) for (n, i, _), c in zip(variants, calls[_BASE_COPIES:])}


def measure_table(space: SearchSpace, **kwargs) -> MeasuredTable:
    """Profiles every valid op of every slot, the stem, the head and the call overhead on the current backend.

    Keyword arguments (all optional):
      method: "in-network" (default) or "standalone" (module docstring).
      batch, reps, warmup, quantile: batch size (1), timing rounds (50), untimed calls per item before the
        rounds (3), statistic of the rounds (0.5: the median).
      calibrate: random sub-networks (numpy seed [seed, 1]) measured end to end in the same rounds (8): the
        standalone method's offset; the in-network method's scale of the op entries and offset
        (``_calibrated_scale``).
      seed: seed of the round order (0).
      base: "in-network" only: the base architecture (op index per slot), default mbconv_k3_e3 everywhere.
      dw_impl: depthwise-convolution implementation passed to the ops ("auto").
    Returns:
      a MeasuredTable (ms at batch ``batch``).
    """
    return measure_table_and_archs(space, (), **kwargs)[0]


def measure_table_and_archs(space: SearchSpace, archs: Sequence, *, method: str = "in-network", batch: int = 1,
                            reps: int = 50, warmup: int = 3, quantile: float = 0.5, calibrate: int = 8,
                            seed: int = 0, base=None, dw_impl: str = "auto") -> tuple:
    """``measure_table`` plus the end-to-end Timing of each of ``archs``, timed in the same rounds.

    The table is computed from the profile's own measurements only; ``archs`` merely share its rounds, so that
    on a machine whose load changes from minute to minute a comparison sees both under the same conditions.
    Returns (MeasuredTable, [Timing per arch]).
    """
    _check_settings(batch, reps, warmup, quantile, calibrate)
    if method not in METHODS:
        raise ProfileError(f"method must be one of {list(METHODS)}, got {method!r}")
    base = tuple(int(i) for i in (np.zeros(space.num_layers, int) if base is None else np.asarray(base)))
    space.validate_arch(base)
    for ops in archs:
        space.validate_arch(ops)
    rep = _representatives(space)
    reps_slots = sorted(set(rep.values()))
    plan = _Plan()
    common = _common_items(plan, space, batch)
    calib = sample_archs(space, calibrate, [seed, 1])
    if method == "standalone":
        pairs = [(n, i) for n in reps_slots for i in _valid_ops(space, n) if i != IDENTITY]
        nets = (calib, [plan.add([c]) for c in arch_calls(space, calib, batch, dw_impl)])
    else:
        pairs = [(n, base[n]) for n in reps_slots if not space.layers[n].keeps_shape]
        nets = _in_network_plan(plan, space, base, reps_slots, batch, dw_impl)
        calib_groups = [plan.add([c]) for c in arch_calls(space, calib, batch, dw_impl)]
    op_groups = _standalone_ops(plan, space, pairs, batch, dw_impl)
    extra = [plan.add([c]) for c in arch_calls(space, archs, batch, dw_impl)]

    raw = time_rounds(plan.groups, reps, warmup, seed)
    q = lambda a: float(np.quantile(a, quantile))
    call, arg_ms, stem_t, head_t = _common_timings(raw, common, q, quantile, reps)
    standalone = {ni: _own(raw[g], k, arg_ms, q) for ni, (g, k) in op_groups.items()}
    settings = {"method": method, "batch": batch, "reps": reps, "warmup": warmup, "quantile": float(quantile),
                "seed": seed, "dw_impl": dw_impl}
    parts = (space, rep, call, arg_ms, stem_t, head_t)
    if method == "standalone":
        per_rep = {n: {OP_NAMES[i]: t for (m, i), t in standalone.items() if m == n} for n in reps_slots}
        table = _calibrated(parts, per_rep, dict(settings, calibrate=calibrate), nets, raw, q)
    else:
        table = _in_network(parts, base, reps_slots, standalone, dict(settings, base=list(base), calibrate=calibrate),
                            nets, raw, q)
        table = _calibrated_scale(table, calib, [q(raw[g][0]) for g in calib_groups])
    return table, [_timing(raw[g][0], quantile) for g in extra]


def _common_items(plan: _Plan, space: SearchSpace, batch: int) -> dict:
    """Reference calls with 0..128 extra arrays, and the (stem, reference) and (head, reference) pairs."""
    key = jax.random.PRNGKey(_WEIGHTS_KEY)
    x = jnp.ones((batch, space.image_size, space.image_size, space.in_channels), jnp.float32)
    ref = _reference((batch, space.num_classes))
    calls = [plan.add([(ref, (tuple(jnp.ones((16,)) for _ in range(k)), x))]) for k in _ARG_COUNTS]
    stem, head = _stem_call(key, space, batch), _head_call(key, space, batch)
    return {"calls": calls, "stem": (plan.add(_paired(stem)), _n_arrays(stem[1][:2])),
            "head": (plan.add(_paired(head)), _n_arrays(head[1][:2]))}


def _own(r, n_arrays: int, arg_ms: float, q) -> Timing:
    """In-network cost of an item timed next to its reference call: q(item) - q(reference) + its arrays' cost
    (>= 0: noise can make tiny items negative); the spread is that of the item's own calls."""
    return Timing(max(q(r[0]) - q(r[1]) + arg_ms * n_arrays, 0.0), _iqr(r[0]), r.shape[1])


def _common_timings(raw, common: dict, q, quantile: float, reps: int) -> tuple:
    """(call Timing, arg_ms, stem Timing, head Timing)."""
    refs = [q(raw[g][0]) for g in common["calls"]]
    arg_ms = max(float(np.polyfit(np.array(_ARG_COUNTS, float), refs, 1)[0]), 0.0)
    stem = _own(raw[common["stem"][0]], common["stem"][1], arg_ms, q)
    head = _own(raw[common["head"][0]], common["head"][1], arg_ms, q)
    return _timing(raw[common["calls"][0]][0], quantile), arg_ms, stem, head


def _calibrated(parts, per_rep, settings, nets, raw, q) -> MeasuredTable:
    """The standalone table; its offset is the median of measured minus modelled ms of the calibration nets."""
    archs, groups = nets
    table = _assemble(*parts, per_rep, settings, {"method": "standalone", "networks": len(archs), "offset_ms": 0.0})
    if not archs:
        return table
    offset = float(np.median([q(raw[g][0]) - predict_arch_ms(table, a) for a, g in zip(archs, groups)]))
    return _with_offset(table, offset)


def _in_network(parts, base, reps_slots, standalone, settings, nets, raw, q) -> MeasuredTable:
    """The in-network table from the base network's copies and its one-slot variants (module docstring)."""
    space, reps = parts[0], settings["reps"]
    base_groups, variant_groups = nets
    t_base = float(np.mean([q(raw[g][0]) for g in base_groups]))
    base_iqr = float(np.mean([_iqr(raw[g][0]) for g in base_groups]))
    delta = {ni: q(raw[g][0]) - t_base for ni, g in variant_groups.items()}  # latency change of each variant
    per_rep = {}
    for n in reps_slots:
        # the base op's cost: the saving of an identity where one is allowed, else its standalone cost
        b_ms = -delta[(n, IDENTITY)] if space.layers[n].keeps_shape else standalone[(n, base[n])].median_ms
        ops = {OP_NAMES[base[n]]: Timing(max(b_ms, 0.0), base_iqr, reps)}
        for i in _valid_ops(space, n):
            if i not in (IDENTITY, base[n]):
                r = raw[variant_groups[(n, i)]][0]
                ops[OP_NAMES[i]] = Timing(max(b_ms + delta[(n, i)], 0.0), _iqr(r), reps)
        per_rep[n] = ops
    table = _assemble(*parts, per_rep, settings, {"method": "in-network",
                                                  "networks": len(base_groups) + len(variant_groups),
                                                  "offset_ms": 0.0})
    offset = t_base - predict_arch_ms(table, base)
    return _with_offset(table, offset)


def _with_offset(table: MeasuredTable, offset: float) -> MeasuredTable:
    """``table`` with the network offset ``offset`` ms, clamped (with a warning) so that call + stem + offset,
    the per-network term a cost table adds to the stem, is >= 0: under load a noisy base network can make the
    fitted offset more negative than that, and a latency table must never hold a negative latency."""
    low = -(table.call.median_ms + table.stem.median_ms)
    if not np.isfinite(offset) or offset < low:
        warnings.warn(f"network offset {offset:.4f} ms clamped to {low:.4f} ms (-(call + stem)): the timings were "
                      "noisy; profile again on a quieter machine or with a lower --quantile", RuntimeWarning,
                      stacklevel=3)
        offset = low
    return table._replace(network=dict(table.network, offset_ms=float(offset)))


def _calibrated_scale(table: MeasuredTable, archs, measured_ms) -> MeasuredTable:
    """The in-network table with its op entries scaled and its offset refitted on whole random networks.

    The one-slot variants of the base network give each op's latency *change* in that one context; summed over a
    network of other ops they miss what the network's single jitted call does differently (per-kernel dispatch
    that overlaps, fusion across layers): the sum of op entries is off by a factor. With the ``archs``' measured
    latencies (timed in the same rounds), ``measured - (call + stem + head) = scale * sum(ops) + offset`` is fitted
    robustly (Theil-Sen: the median of pairwise slopes, then the median residual), scale kept in [0.25, 4]. Fewer
    than 3 networks, or no spread in their op sums (on a tiny space under load every op entry can clamp to 0): the
    op entries and offset are returned unchanged. ``network.networks`` counts the ``archs`` either way: they were
    timed.
    """
    table = table._replace(network=dict(table.network, networks=table.network["networks"] + len(archs)))
    if len(archs) < 3:
        return table
    fixed = table.call.median_ms + table.stem.median_ms + table.head.median_ms
    x = np.array([predict_arch_ms(table, a) - table.fixed_ms for a in archs])
    y = np.asarray(measured_ms, float) - fixed
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    ok = np.abs(dx) > 1e-9
    if not ok.any():
        return table
    scale = float(np.clip(np.median((y[j] - y[i])[ok] / dx[ok]), 0.25, 4.0))
    slots = tuple(dict(s, ops={k: Timing(t.median_ms * scale, t.spread_ms * scale, t.reps)
                               for k, t in s["ops"].items()}) for s in table.slots)
    table = table._replace(slots=slots)
    return _with_offset(table, float(np.median(y - scale * x)))


def _iqr(samples) -> float:
    q25, q75 = np.percentile(samples, [25, 75])
    return float(q75 - q25)


def _assemble(space, rep, call, arg_ms, stem, head, per_rep, settings, network) -> MeasuredTable:
    """A MeasuredTable whose slots take their ops from their representative slot."""
    slots = tuple({"index": s.index, "shape": slot_shape(s), "ops": dict(sorted(
        per_rep[rep[s.index]].items(), key=lambda kv: OP_NAMES.index(kv[0])))} for s in space.layers)
    return MeasuredTable(backend_info(), settings, space_summary(space), slots, call, arg_ms, stem, head, network)
