"""The main job: ``search(config, workdir)`` runs stage 1, repairs the budget, retrains, reports.

Both stages train in the run layer's epoch loop (``jmsnas.run.loop``): everything a run needs to continue is
checkpointed (orbax) every ``checkpoint_every`` steps and at epoch ends (every ``checkpoint_min_interval_s``
seconds at most, and after each stage's last epoch): the whole state plus the position in the data and the
history. ``resume=True`` continues from the latest checkpoint; because batches are a pure function of (seed,
epoch, position) and the PRNG key is part of the state, a resumed run ends with the same architecture as an
uninterrupted one.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jmsnas import (ahead as A, budget, data, dwconv, gates as G, limits as L, programs, runcheck, supernet,
                    tensorboard as tb, timing, topology, train)
from jmsnas.checkpoint import Checkpointer
from jmsnas.compose import flow as composed
from jmsnas.cost.latency import arch_latency, best_assignment, breakdown_dict, expected_latency, searched_latency
from jmsnas.cost.tables import CostTable, analytic_table
from jmsnas.objectives import PENALTIES
from jmsnas.run import directory, loop
from jmsnas.run import workdir as W
from jmsnas.runcheck import ConfigError
from jmsnas import space as S
from jmsnas.space import OP_NAMES, SearchSpace, adapt_schedule, build_space
from jmsnas.topology import Topology


def validate_config(cfg) -> None:
    """Checks the values that would otherwise fail deep inside a run (before anything is loaded or written)."""
    runcheck.check_values(cfg)
    tb.enabled(cfg)  # a bool
    runcheck.check_bounds(cfg, {"t_const_ms": dict(low=0, low_open=True),
                                **{f"search.{k}": dict(low=int(k != "warmup_epochs"), integer=True)
                                   for k in ("warmup_epochs", "epochs", "batch_size", "arch_every")}})
    data.check_name(cfg.dataset)
    topo = topology.resolve(cfg.topology, cfg.get("layers_per_device"))  # a preset or a topology file
    if topo.kind == "star":
        raise ConfigError(f"topology {cfg.topology!r} is a star of {len(topo.branches)} source devices (sensors); "
                          "search and evolve need one source device (a chain or a mesh); split it with jmsnas split")
    if topo.kind == "cluster":
        raise ConfigError(f"topology {cfg.topology!r} links every pair of its {topo.num_devices} devices (a cluster); "
                          "search and evolve need a chain or a mesh; a cluster runs separable networks "
                          "(jmsnas separable --config.cluster.topology=FILE)")
    try:  # the composed search's switches and the topology's quantize fields (docs/composed.md)
        composed.check(cfg, topo)
    except ValueError as e:
        raise ConfigError(f"compose.{e}" if str(e).startswith(("modules", "weight_bits", "activation_bits", "module_optional",
                                                                  "send_input"))
                          else str(e)) from None
    try:  # the per-device schedule on this topology (shapes only; the data's sizes are not known yet)
        _space(cfg, topo, image_size=8, channels=1, num_classes=2)
    except ValueError as e:
        raise ConfigError(f"space on topology {topo.name!r}: {e}") from None
    s = cfg.search
    n_dev = jax.device_count()
    for name, bs in (("search.batch_size", s.batch_size), ("eval_batch_size", cfg.eval_batch_size)):
        if bs % n_dev:
            raise ConfigError(f"{name}={bs} must be divisible by the number of devices ({n_dev})")
    for key, value, known in (("split", cfg.split, train.SPLITS), ("search.gate_mode", s.gate_mode, G.GATE_MODES),
                              ("search.penalty", s.get("penalty", "two_sided"), PENALTIES),
                              ("dw_impl", cfg.get("dw_impl", "auto"), dwconv.IMPLS),
                              ("candidate_impl", cfg.get("candidate_impl", "auto"), supernet.CANDIDATE_IMPLS)):
        if value not in known:
            raise ConfigError(f"unknown {key} {value!r}; expected one of {list(known)}")


def build(cfg, ds):
    """(space, table) of the configuration on data of ``ds``'s sizes (``image_size``, ``channels``,
    ``num_classes``: a loaded ``data.Dataset`` or anything with those). The space's per-device widths and strides
    are resampled to the topology's devices when the config gives another number (``space.adapt_schedule``)."""
    space = _space(cfg, topology.resolve(cfg.topology, cfg.get("layers_per_device")), ds.image_size, ds.channels,
                   ds.num_classes)
    return space, make_table(space, cfg)


def _space(cfg, topo: Topology, image_size: int, channels: int, num_classes: int) -> SearchSpace:
    """The configured space on ``topo`` for images of that size and channels and that many classes."""
    sc = cfg.space
    dev_channels, strides = adapt_schedule(topo, tuple(sc.device_channels), tuple(sc.device_strides))
    return build_space(topo, image_size=image_size, in_channels=channels, num_classes=num_classes,
                       device_channels=dev_channels, device_strides=strides, stem_channels=sc.stem_channels,
                       stem_stride=sc.stem_stride, head_channels=sc.head_channels)


def make_table(space: SearchSpace, cfg) -> CostTable:
    """The cost table: per-device sources from ``cost.tables`` (see jmsnas.cost.build), else the roofline."""
    tables_cfg = cfg.cost.get("tables")
    if tables_cfg:
        from jmsnas.cost.build import build_table  # measured / imported / fitted tables
        return build_table(space, dict(tables_cfg), activation_bits=cfg.cost.activation_bits)
    return analytic_table(space, cfg.cost.activation_bits)


def _hparams(cfg, space: SearchSpace | None = None, table: CostTable | None = None) -> train.SearchHParams:
    """The search's hyper-parameters; the devices' limits term (``search.lambda_limits``) only when ``space``
    and ``table`` are given and some architecture could exceed a device's limit (else the term is 0 anyway)."""
    s = cfg.search
    bits = cfg.cost.activation_bits
    lam = float(s.get("lambda_limits", 0.0))
    if lam and (space is None or not L.binding(space, table, L.device_limits(space, bits),
                                               any_split=cfg.split == "searched")):
        lam = 0.0
    return train.SearchHParams(s.weight_lr, s.arch_lr, s.lambda1, s.lambda2, float(cfg.t_const_ms), s.penalty,
                               s.gate_mode, s.tau0, s.tau_min, s.tau_decay, cfg.split, lam, bits)


def check_limits(cfg, space: SearchSpace, table: CostTable) -> L.DeviceLimits:
    """The devices' limits; ConfigError (one line naming the device and what it would need) when no architecture
    meets T_const and every device's memory and energy together under D^m (the split a searched split may always
    fall back to). Called before the workdir is claimed."""
    lim = L.device_limits(space, cfg.cost.activation_bits)
    try:
        budget.check_feasible(space, table, lim, float(cfg.t_const_ms))
    except L.LimitsError as e:
        raise ConfigError(str(e)) from None
    return lim


def check_run(cfg, space: SearchSpace, ds, batch_size: int, paths: int, extra_bytes: int = 0,
              extra_what: str = "") -> None:
    """What would fail after the workdir is prepared: batch sizes against the splits, one step's memory (plus
    ``extra_bytes``, e.g. an evolution's population)."""
    for name, split in (("train", ds.train), ("val", ds.val)):
        if batch_size > split.labels.shape[0]:
            raise ConfigError(f"search.batch_size={batch_size} is larger than the {name} split "
                              f"({split.labels.shape[0]} examples): an epoch would have no batch")
    runcheck.check_memory(space, batch_size, paths, f"image_size={space.image_size}", extra_bytes, extra_what)


def load_data(cfg) -> data.Dataset:
    """The dataset the configuration names (``data.from_config``); the configuration is not changed."""
    return data.from_config(cfg)


@timing.measured
def search(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False, progress: bool = True) -> dict:
    """Runs both stages and writes result.json, plots, per-device parts and checkpoints into ``workdir``."""
    validate_config(cfg)
    stored = W.plain(cfg)
    W.check_workdir(workdir, resume, stored, "search")
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    with start_ahead() as ahead:
        ds = load_data(cfg)
        space, table = build(cfg, ds)
        paths = 2 if cfg.search.gate_mode == "two_path" else len(OP_NAMES)  # candidates a layer computes per step
        check_run(cfg, space, ds, cfg.search.batch_size, paths)
        lim = check_limits(cfg, space, table)
        W.claim(workdir, resume, stored, "search")
        mesh = train.data_mesh()
        fp = W.fingerprint(cfg, S.to_dict(space))
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints", "search"))
        with tb.run(workdir, tb.enabled(cfg)):
            if not composed.choices_of(cfg, space.topology).off:  # a mechanism of compose is on
                return composed.run(cfg, space, table, ds, lim, mesh, workdir, fp, resume, progress,
                                    _hparams(cfg, space, table), ahead)
            st, history = _stage1(cfg, space, table, ds, mesh, ckpt, fp, resume, progress, ahead)
            check_alpha(st.alpha)
            alpha = np.asarray(st.alpha)
            # decided (and its steps compiled) since the search's last batch (_compile_retrain), else here
            derived, fix, ops, split = (ahead.built(("retrain", alpha.tobytes()))
                                        or decide(cfg, space, table, alpha, lim))
            rt, history = retrain(cfg, space, ds, mesh, st, ops, workdir, fp, resume, progress, history)
            return finish(cfg, space, table, ds, mesh, rt, ops, split, fix, derived, history, workdir)


def start_ahead() -> A.Ahead:
    """The run's ahead-of-time compiler (``jmsnas.ahead``), already building the native CPU kernels (a C++
    compiler in child processes) while the data loads. Nothing ahead in a multi-process run."""
    ahead = A.Ahead(None if jax.process_count() == 1 else 0)
    if jax.default_backend() == "cpu":
        from jmsnas import native
        ahead.submit(native.load)
    return ahead


def _first_batches(ds, batch_size: int, eval_batch_size: int, mesh):
    """Abstract (x, y) of a training batch and (x, y, valid) of an evaluation batch, placed as the run places
    them (``train.shard_batch``): the arguments the steps are compiled for ahead."""
    x, y = ds.train.images[:batch_size], ds.train.labels[:batch_size]
    return (A.abstract(train.shard_batch((x, y), mesh)),
            A.abstract(train.shard_batch(next(train.padded_eval_batches(ds.val, eval_batch_size)), mesh)))


def _compile_stage1(ahead: A.Ahead, cfg, space, ds, mesh, shapes, steps, latencies):
    """Stage 1's steps compiled ahead, all at once, for the state of ``shapes`` (``jax.eval_shape`` of its
    initialisation) placed as the run places it: (weight_step, arch_step, eval_step, latencies), each waiting at
    its first call for its compilation."""
    weight_step, arch_step, eval_step = steps
    (x, y), (xe, ye, valid) = _first_batches(ds, cfg.search.batch_size, cfg.eval_batch_size, mesh)
    state = A.abstract(shapes, train.replicated(mesh))
    ops = A.abstract(jax.eval_shape(lambda a: G.derive(a, space.mask()), state.alpha), train.replicated(mesh))
    # in the order they are first needed: the first batch, the end of epoch 0, the first architecture step
    weight_step = ahead.compile(weight_step, state, x, y)
    eval_step = ahead.compile(eval_step, state.params, state.bn, ops, xe, ye, valid)
    latencies.expected = ahead.compile(latencies.expected, state.alpha)
    if cfg.split == "fixed":
        latencies.derived = ahead.compile(latencies.derived, ops, None)
    arch_step = ahead.compile(arch_step, state, x, y)
    return weight_step, arch_step, eval_step, latencies


class Decision(NamedTuple):
    """The architecture the search ends with: ``derived`` (alpha's argmax), ``fix`` (``budget.repair``'s),
    ``ops`` (the repaired architecture as a tuple) and ``split`` (its layer->device assignment, None for D^m)."""
    derived: np.ndarray
    fix: budget.Repair
    ops: tuple
    split: object


def decide(cfg, space, table, alpha, lim: L.DeviceLimits) -> Decision:
    """The search's end: alpha derived, repaired to the budget and every device's limits, and re-split (the
    repaired net's T can only fall)."""
    derived = np.asarray(G.derive(alpha, space.mask()))
    split = assignment(cfg, space, table, derived, lim)
    fix = budget.repair(space, table, alpha, derived, float(cfg.t_const_ms), split, lim)
    return Decision(derived, fix, tuple(int(i) for i in fix.ops), assignment(cfg, space, table, fix.ops, lim))


def _compile_retrain(ahead: A.Ahead, cfg, space, table, ds, mesh, st) -> None:
    """Decide the architecture the search ends with (:func:`decide` of ``st.alpha``, as ``search`` does next) and
    compile its retraining steps, in threads, while the search's last epoch is evaluated and checkpointed, under
    the key ``("retrain", alpha's bytes)`` (``Ahead.speculate``): ``search`` takes the decision from there
    (``Ahead.built``), so that its small executables (the repair's, the latency sums') compile once, off the
    main thread."""
    alpha = np.array(st.alpha)  # a copy: st may be donated meanwhile
    state = A.abstract(st)
    (x, y), (xe, ye, valid) = _first_batches(ds, cfg.search.batch_size, cfg.eval_batch_size, mesh)
    r = cfg.retrain

    def build(key):
        # alpha placed as the state's (replicated on the mesh), so that its argmax is the per-epoch one's executable
        decision = decide(cfg, space, table, train.replicate(alpha, mesh),
                          L.device_limits(space, cfg.cost.activation_bits))
        ops = decision.ops
        train_step, eval_step = retrain_steps(space, ops, r.lr, cfg.search.lambda1, cfg.dw_impl)
        shapes = jax.eval_shape(lambda s: train.init_retrain_state(space, s, ops, r.lr), state)
        rt = A.abstract(shapes, train.replicated(mesh))
        host_params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shapes.params)
        evaluate = lambda: (eval_step.lower(rt.params, rt.bn, xe, ye, valid).compile(),
                            train.adam_init(r.lr).lower(host_params).compile())
        beside = ahead.submit(evaluate) if ahead.workers > 1 else None  # this thread holds one worker
        train_step.lower(rt, x, y).compile()
        beside.result() if beside is not None else evaluate()
        return decision

    ahead.speculate(lambda: ("retrain", alpha.tobytes()), build)


def assignment(cfg, space, table, ops, lim: L.DeviceLimits | None = None):
    """The layer->device split: D^m (None) when fixed, the exact best split of ``ops`` (eq. (1) on a chain, eq. (2)
    on a mesh) when searched, within every device's limits when ``lim`` can bind (D^m when no split of ``ops``
    fits them)."""
    if cfg.split == "fixed":
        return None
    if lim is not None and L.binding(space, table, lim, any_split=True):
        return L.best_split(space, table, lim, ops)
    onehot = jax.nn.one_hot(jnp.asarray(ops), len(OP_NAMES))
    return np.asarray(best_assignment(space, table, onehot))


def search_steps(cfg, space: SearchSpace, table: CostTable):
    """(weight_step, arch_step, eval_step) of ``train.make_search_steps`` as the configuration asks, each with
    its traced program kept for later runs (``programs.persistent_jit``)."""
    made = (space, table, _hparams(cfg, space, table), cfg.dw_impl, cfg.get("candidate_impl", "auto"))
    steps = train.make_search_steps(*made)
    return tuple(programs.persistent_jit(step, name=f"search.{name}", identity=made, donate_argnums=donate)
                 for step, name, donate in zip(steps, ("weight_step", "arch_step", "eval_step"), (0, 0, ())))


@functools.lru_cache(maxsize=16)  # the same steps for the same network: finish reuses the retraining's
def retrain_steps(space: SearchSpace, ops: tuple, lr: float, lambda1: float, dw_impl: str):
    """(train_step, eval_step) of ``train.make_retrain_steps``, each with its traced program kept for later runs."""
    made = (space, ops, lr, lambda1, dw_impl)
    train_step, eval_step = train.make_retrain_steps(*made)
    return (programs.persistent_jit(train_step, name="retrain.train_step", identity=made, donate_argnums=0),
            programs.persistent_jit(eval_step, name="retrain.eval_step", identity=made))


def check_alpha(alpha, what: str = "the search") -> None:
    """ConfigError when the architecture parameters hold NaN or inf (a diverged search or a damaged state):
    no architecture can be derived from them."""
    a = np.asarray(alpha)
    if not np.all(np.isfinite(a)):
        raise ConfigError(f"the architecture parameters alpha hold {int((~np.isfinite(a)).sum())} NaN/inf value(s) "
                          f"after {what}: training diverged; lower search.weight_lr / search.arch_lr or "
                          f"search.lambda2, or start again")


def _stage1(cfg, space, table, ds, mesh, ckpt, fp, resume, progress, ahead: A.Ahead | None = None):
    """Stage 1 (warm-up, then weight and architecture steps) on the run layer's epoch loop; (state, history). With
    ``ahead``, its steps are compiled in threads while the supernet initialises, and the retraining's once alpha is
    final."""
    hp = _hparams(cfg)
    s = cfg.search
    weight_step, arch_step, eval_step = search_steps(cfg, space, table)
    latencies = _EpochLatencies(cfg, space, table)
    init = lambda: train.init_search_state(jax.random.PRNGKey(cfg.seed), space, hp, cfg.shared_weights)
    if ahead is not None:  # compiled in threads while the supernet initialises
        weight_step, arch_step, eval_step, latencies = _compile_stage1(
            ahead, cfg, space, ds, mesh, jax.eval_shape(init), (weight_step, arch_step, eval_step), latencies)
    n_val = data.num_batches(ds.val, s.batch_size)
    total = s.warmup_epochs + s.epochs
    metrics = {}

    def step(st, epoch, i, batch):
        st, m = weight_step(st, *train.shard_batch(batch, mesh))
        metrics.update(m)
        if epoch >= s.warmup_epochs and i % s.arch_every == 0:
            j = (i // s.arch_every) % n_val
            xv, yv = next(data.epoch_batches(ds.val, s.batch_size, seed=cfg.seed + 1, epoch=epoch, start=j))
            st, m = arch_step(st, *train.shard_batch((xv, yv), mesh))
            metrics.update(m)
        return st, metrics

    def end_epoch(st, epoch, m):
        if ahead is not None and epoch == total - 1 and cfg.retrain.epochs > 0:  # alpha is final
            _compile_retrain(ahead, cfg, space, table, ds, mesh, st)
        row = _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, epoch < s.warmup_epochs, m, latencies)
        if tb.active():
            tb.log(epoch, _search_scalars(cfg, space, latencies, st, row))
        return row

    return loop.epochs(
        init(), cfg=cfg, ckpt=ckpt, fp=fp, resume=resume, total=total, split=ds.train, batch_size=s.batch_size,
        seed=cfg.seed, step=step, place=lambda st: train.replicate(st, mesh), desc="search", progress=progress,
        end_epoch=end_epoch, postfix=lambda st, m: {"loss": f"{float(m['loss']):.3f}", "acc": f"{float(m['acc']):.3f}",
                                                    "ET": f"{float(latencies.expected(st.alpha)):.3f}ms"})


class _EpochLatencies:
    """E[T] of alpha (the objective's) and T of a derived architecture, each one executable for the whole stage
    (evaluated eagerly they dispatched a few hundred small operations per call); ``breakdown``: E[T] per device
    and link with the architecture probabilities (for the TensorBoard logs)."""

    def __init__(self, cfg, space, table):
        self.expected = jax.jit(lambda alpha: train.step_latency(space, table, alpha, cfg.split))
        self.derived = jax.jit(lambda ops, assignment: arch_latency(space, table, ops, assignment).total)

        def breakdown(alpha):
            probs = G.probabilities(alpha, jnp.asarray(space.mask()))
            if cfg.split == "searched":  # E[T] under the best split of E[tau], as the objective takes it
                return searched_latency(space, table, probs)[0], probs
            return expected_latency(space, table, alpha), probs

        self.breakdown = jax.jit(breakdown)


def _search_scalars(cfg, space, latencies, st, row) -> dict:
    """An epoch of stage 1 for TensorBoard: the history row, E[T] per device and link, per-layer entropy and top
    op of the architecture distribution, and the Gumbel temperature of the gate modes that sample with one."""
    lat, probs = latencies.breakdown(st.alpha)
    out = {**tb.history_scalars(row), **tb.breakdown_scalars("latency/expected", breakdown_dict(space, lat)),
           **tb.arch_scalars(jax.device_get(probs))}
    s = cfg.search
    if s.gate_mode in ("gumbel_soft", "gumbel_hard"):  # the modes that sample with tau (gates.arch_gates)
        out["search/gumbel_temperature"] = float(G.temperature_schedule(s.tau0, s.tau_min, s.tau_decay)(int(st.step)))
    return out


def _epoch_entry(cfg, space, table, ds, mesh, st, eval_step, epoch, warm, metrics, latencies) -> dict:
    ops = G.derive(st.alpha, space.mask())
    acc, _ = train.evaluate(lambda x, y, v: eval_step(st.params, st.bn, ops, x, y, v), ds.val,
                            cfg.eval_batch_size, mesh)
    return {"epoch": epoch, "stage": "warmup" if warm else "search", "train_loss": float(metrics["loss"]),
            "train_acc": float(metrics["acc"]), "val_acc": acc,
            "expected_latency_ms": float(latencies.expected(st.alpha)),
            "derived_latency_ms": float(latencies.derived(ops, assignment(cfg, space, table, np.asarray(ops))))}


def retrain(cfg, space, ds, mesh, st, ops, workdir, fp, resume, progress, history):
    """Stage 2: trains the network ``ops`` (weights inherited from the search state ``st``) for
    ``cfg.retrain.epochs`` on the run layer's epoch loop, checkpointed under ``checkpoints/retrain``; returns
    (state, history with one row per epoch appended)."""
    r = cfg.retrain
    train_step, eval_step = retrain_steps(space, ops, r.lr, cfg.search.lambda1, cfg.dw_impl)
    bs = cfg.search.batch_size
    first = len(history)  # the retraining's rows continue the search's numbering

    def end_epoch(rt, epoch, metrics):
        acc, _ = train.evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), ds.val, cfg.eval_batch_size,
                                mesh)
        row = {"epoch": first + epoch, "stage": "retrain", "train_loss": float(metrics["loss"]),
               "train_acc": float(metrics["acc"]), "val_acc": acc, "expected_latency_ms": None,
               "derived_latency_ms": None}
        tb.log(row["epoch"], tb.history_scalars(row))
        return row

    rt, history = loop.epochs(
        train.init_retrain_state(space, jax.device_get(st), ops, r.lr), cfg=cfg,
        ckpt=Checkpointer(os.path.join(workdir, "checkpoints", "retrain")), fp=fp, resume=resume, total=r.epochs,
        split=ds.train, batch_size=bs, seed=cfg.seed + 2,
        step=lambda rt, epoch, i, batch: train_step(rt, *train.shard_batch(batch, mesh)),
        place=lambda rt: train.replicate(rt, mesh), end_epoch=end_epoch, desc="retrain", progress=progress,
        postfix=lambda rt, m: {"loss": f"{float(m['loss']):.3f}", "acc": f"{float(m['acc']):.3f}"},
        extra_meta={"ops": list(ops)}, history=history)
    return rt, history


def finish(cfg, space, table, ds, mesh, rt, ops, split, fix, derived, history, workdir, *,
           note: str | None = None, extra: dict | None = None) -> dict:
    """Evaluates the retrained net and writes result.json, history.json, the report and parts/. ``note``
    replaces the budget note and ``extra`` adds keys to result.json (for flows other than the search)."""
    _, eval_step = retrain_steps(space, ops, cfg.retrain.lr, cfg.search.lambda1, cfg.dw_impl)
    val_acc, test_acc = train.final_accuracy(eval_step, rt, ds, cfg.eval_batch_size, mesh)
    lat = breakdown_dict(space, arch_latency(space, table, jnp.asarray(ops), split))
    devices = space.layer_devices() if split is None else split
    train.fill_derived_latency(history, lat["total"])
    names = space.topology.device_names
    params = jax.device_get(rt.params)
    result = {
        "flow": "search", "topology": space.topology.name, "space": S.to_dict(space),
        "t_const_ms": float(cfg.t_const_ms),
        "architecture": [{"layer": s.index, "device": names[int(d)], "op": OP_NAMES[i]}
                         for s, i, d in zip(space.layers, ops, devices)],
        "split": cfg.split,
        "latency_ms": lat, "accuracy": {"val": val_acc, "test": test_acc},
        "params": supernet.count_params(params),
        "budget": {"met": bool(budget.within(lat["total"], cfg.t_const_ms)), "repaired": bool(fix.repaired),
                   "min_reachable_ms": fix.min_latency_ms,
                   "note": _budget_note(fix, derived, cfg.t_const_ms) if note is None else note},
        "dataset": ds.name, "seed": cfg.seed,
        **L.report(space, table, L.device_limits(space, cfg.cost.activation_bits), ops, split),
        **(extra or {}),
    }
    if timing.active() is not None:  # compile and run time so far (wall, CPU): the only entry that varies by run
        result["time"] = timing.summary()
    figures = directory.write_outputs(workdir, result, history,
                                      lambda: write_parts(space, params, jax.device_get(rt.bn), ops, workdir, split))
    if tb.active():
        step = len(history)
        parts = [supernet.device_parts(space, tree, ops, split) for tree in (params, jax.device_get(rt.bn))]
        held = {d: sum(supernet.count_params(p[d]["params"]) for p in parts) for d in parts[0]}
        tb.log(step, {**tb.result_scalars(result), **tb.device_memory_scalars(held)})
        tb.images(step, tb.figures(figures))
    return result


def _budget_note(fix, derived, t_const) -> str:
    if not fix.feasible:
        return (f"no architecture of this space meets T_const={t_const:.4g} ms; the fastest reachable is "
                f"{fix.min_latency_ms:.4g} ms and is used")
    if fix.repaired:
        return (f"the derived architecture exceeded T_const; repaired to the most probable architecture within it "
                f"(log-probability loss {fix.logprob_loss:.3f})")
    return "the derived (argmax) architecture meets T_const"


def write_parts(space: SearchSpace, params, bn, ops, workdir: str, split=None) -> dict:
    """Per-device parts ready to deploy: ``parts/<device>.npz`` (weights + BN statistics) and
    ``parts/manifest.json`` with the space (``run.directory.write_parts``); ``split``: the layer -> device
    assignment (None: the topology's D^m)."""
    parts = supernet.device_parts(space, params, ops, split)
    bn_parts = supernet.device_parts(space, bn, ops, split)
    return directory.write_parts(workdir, {
        dev: {"params": part["params"], "bn": bn_parts[dev]["params"], "layers": part["layers"], "ops": part["ops"],
              "input_shape": _io_shape(space, part["layers"], first=True),
              "output_shape": _io_shape(space, part["layers"], first=False)}
        for dev, part in parts.items()}, {"op_names": list(OP_NAMES), "space": S.to_dict(space)})


def _io_shape(space, layers, first: bool):
    if not layers:
        return None  # the device only relays the tensor it receives
    s = space.layers[layers[0] if first else layers[-1]]
    return [s.in_hw, s.in_hw, s.in_ch] if first else [s.out_hw, s.out_hw, s.out_ch]
