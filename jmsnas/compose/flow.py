"""The composed search end to end, as ``jmsnas search`` runs it when a mechanism of ``compose`` is on: stage 1 over
every group of choices (``compose.steps``), the derivation and the exact repair (``compose.repair``; under a
searched split ``compose.anysplit`` over every split), stage 2 on the derived network with its modules and fake
quantization, and result.json / summary.txt / the plots listing every cut's module and every layer's bits.

``jmsnas.pipeline.search`` validates the configuration, builds the space and the table, claims the workdir and
then calls :func:`run`; with every mechanism off it never comes here (today's search runs unchanged).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ahead as A, budget, data, limits as L, programs, supernet, tensorboard as tb, timing, train
from jmsnas.checkpoint import Checkpointer
from jmsnas.compose import anysplit, cost as K, net as N, network as CN, repair as R, steps as S
from jmsnas.compose.choices import ChoiceProbs, Choices, make_choices, onehot, probs_from_logits
from jmsnas.compose.terms import boundary_shapes, build_terms, input_boundary, module_channels
from jmsnas.cost.latency import breakdown_dict
from jmsnas.run import directory, loop
from jmsnas.runcheck import ConfigError
from jmsnas import space as SP
from jmsnas.space import OP_NAMES

ANY_SPLIT_MAX = 400  # splits: above this many, the repair runs under the best split of the expectations only


def choices_of(cfg, topology) -> Choices:
    """The configuration's ``Choices`` (``compose.modules``, ``compose.weight_bits``, ``compose.activation_bits``,
    ``compose.module_optional``, ``compose.send_input``;
    all off when the configuration has no ``compose``) on ``topology``, whose devices' ``quantize`` fields (None:
    make_choices' default for that device) say which quantize. ValueError naming the bad value."""
    c = cfg.get("compose") or {}
    get = lambda k: () if c.get(k) is None else c.get(k)
    default = make_choices(topology).quantize
    given = [d.quantize for d in topology.devices]
    quantize = None if all(q is None for q in given) else tuple(d if q is None else q for q, d in zip(given, default))
    optional = True if c.get("module_optional") is None else c.get("module_optional")
    send_input = False if c.get("send_input") is None else c.get("send_input")
    return make_choices(topology, get("modules"), get("weight_bits"), get("activation_bits"), quantize, optional,
                        send_input)


def check(cfg, topology) -> Choices:
    """``choices_of``, with the composed search's own limit: sending the input under a searched split only (D^m
    keeps the stem on the first device)."""
    ch = choices_of(cfg, topology)
    if ch.send_input and cfg.get("split", "fixed") != "searched":
        raise ValueError(f"compose.send_input=True moves the stem, which needs split='searched'; got "
                         f"split={cfg.get('split', 'fixed')!r} (D^m keeps the stem on the first device)")
    return ch


def run(cfg, space, table, ds, lim: L.DeviceLimits, mesh, workdir: str, fp: str, resume: bool, progress: bool,
        hp: train.SearchHParams, ahead: A.Ahead | None = None) -> dict:
    """Both stages of the composed search into ``workdir`` (already claimed); returns result.json's dict.
    ``ahead``: the run's ahead-of-time compiler (``jmsnas.ahead``): stage 1's steps compile in its threads."""
    choices = check(cfg, space.topology)
    terms = build_terms(space, table, choices, cfg.cost.activation_bits)
    limits = lim if hp.lambda_limits else None
    st, history = _stage1(cfg, space, table, terms, choices, hp, limits, ds, mesh, workdir, fp, resume, progress,
                          ahead)
    logits = ChoiceProbs(*(np.asarray(a) for a in jax.device_get(st.logits)))
    for a in logits:
        if not np.all(np.isfinite(a)):
            raise ConfigError("the architecture logits hold NaN/inf after the search: training diverged; lower "
                              "search.weight_lr / search.arch_lr or search.lambda2, or start again")
    fix, split, how = decide(cfg, space, table, terms, choices, logits, lim)
    net = N.derived(space, choices, fix.config, split)
    rt, history = _retrain(cfg, space, net, ds, mesh, st, workdir, fp, resume, progress, history)
    return _finish(cfg, space, table, terms, choices, lim, ds, mesh, rt, net, fix, split, how, history, workdir)


def _stage1(cfg, space, table, terms, choices, hp, limits, ds, mesh, workdir, fp, resume, progress, ahead):
    s = cfg.search
    made = (space, table, terms, choices, hp, limits, cfg.dw_impl, cfg.get("candidate_impl", "auto"))
    weight_step, arch_step, eval_step = (
        programs.persistent_jit(step, name=f"compose.{name}", identity=made, donate_argnums=donate)
        for step, name, donate in zip(S.make_steps(*made), ("weight_step", "arch_step", "eval_step"), (0, 0, ())))
    lat = S.latencies(space, table, terms, choices, hp.split)
    make = lambda key: S.init_state(key, space, choices, hp, hp.split, cfg.shared_weights)
    if ahead is not None:  # compiled in threads while the supernet initialises (as the plain search does)
        state = A.abstract(jax.eval_shape(make, jax.random.PRNGKey(cfg.seed)), train.replicated(mesh))
        x, y = A.abstract(train.shard_batch((ds.train.images[:s.batch_size], ds.train.labels[:s.batch_size]), mesh))
        ev = A.abstract(train.shard_batch(next(train.padded_eval_batches(ds.val, cfg.eval_batch_size)), mesh))
        weight_step = ahead.compile(weight_step, state, x, y)
        eval_step = ahead.compile(eval_step, state.params, state.bn, state.logits, *ev)
        lat = ahead.compile(lat, state.logits)
        arch_step = ahead.compile(arch_step, state, x, y)
    init = make(jax.random.PRNGKey(cfg.seed))
    n_val = data.num_batches(ds.val, s.batch_size)

    def step(st, epoch, i, batch):
        st, m = weight_step(st, *train.shard_batch(batch, mesh))
        if epoch >= s.warmup_epochs and i % s.arch_every == 0:
            j = (i // s.arch_every) % n_val
            xv, yv = next(data.epoch_batches(ds.val, s.batch_size, seed=cfg.seed + 1, epoch=epoch, start=j))
            st, ma = arch_step(st, *train.shard_batch((xv, yv), mesh))
            m = {**m, **ma}
        return st, m

    def end_epoch(st, epoch, m):
        acc, _ = train.evaluate(lambda x, y, v: eval_step(st.params, st.bn, st.logits, x, y, v), ds.val,
                                cfg.eval_batch_size, mesh)
        e, t = lat(st.logits)
        row = {"epoch": epoch, "stage": "warmup" if epoch < s.warmup_epochs else "search",
               "train_loss": float(m["loss"]), "train_acc": float(m["acc"]), "val_acc": acc,
               "expected_latency_ms": float(e), "derived_latency_ms": float(t)}
        if tb.active():
            probs = jax.device_get(probs_from_logits(space, choices, st.logits))
            tb.log(epoch, {**tb.history_scalars(row), **tb.arch_scalars(probs.ops),
                           **tb.composed_scalars(choices, probs, space.topology.link_names)})
        return row

    return loop.epochs(
        init, cfg=cfg, ckpt=Checkpointer(os.path.join(workdir, "checkpoints", "search")), fp=fp, resume=resume,
        total=s.warmup_epochs + s.epochs, split=ds.train, batch_size=s.batch_size, seed=cfg.seed, step=step,
        place=lambda st: train.replicate(st, mesh), desc="composed search", progress=progress, end_epoch=end_epoch,
        postfix=lambda st, m: {"loss": f"{float(m['loss']):.3f}", "acc": f"{float(m['acc']):.3f}"})


def decide(cfg, space, table, terms, choices: Choices, logits: ChoiceProbs, lim: L.DeviceLimits) -> tuple:
    """(ComposedRepair, split int32[N] or None for D^m, how the split was chosen): the most probable configuration
    within T_const and, where they can bind, the devices' limits. Under a searched split on a chain the repair
    runs over every split (``anysplit``, exact) when there are at most ``ANY_SPLIT_MAX`` of them and no limit
    binds; otherwise under the best split of the current expectations."""
    t_const = float(cfg.t_const_ms)
    topo = space.topology
    binds = L.binding(space, table, lim, any_split=cfg.split == "searched")  # (its bounds put the stem anywhere)
    limits = lim if binds and topo.kind in ("chain", "mesh") else None
    if cfg.split == "fixed":
        return R.repair(space, table, terms, choices, logits, t_const, None, limits), None, "fixed (D^m)"
    count = sum(1 for _ in anysplit.splits(space, choices.send_input))
    if limits is None and count <= ANY_SPLIT_MAX:
        fix, split = anysplit.repair_any_split(space, table, terms, choices, logits, t_const)
        return fix, np.asarray(split), f"searched with the configuration over all {count} splits"
    split = np.asarray(K.best_assignment(space, table, terms, probs_from_logits(
        space, choices, ChoiceProbs(*(jnp.asarray(a) for a in logits)))))
    return (R.repair(space, table, terms, choices, logits, t_const, split, limits), split,
            "the best split of the search's final expectations")


def retrain_steps(cfg, space, net: N.Derived):
    """(train_step, eval_step) of the derived network, each with its traced program kept for later runs."""
    return _retrain_steps(space, net, float(cfg.retrain.lr), float(cfg.search.lambda1), cfg.dw_impl)


@functools.lru_cache(maxsize=16)  # the same wrappers for the retraining and the final evaluation
def _retrain_steps(*made):
    train_step, eval_step = S.make_retrain_steps(*made)
    return (programs.persistent_jit(train_step, name="compose.retrain_step", identity=made, donate_argnums=0),
            programs.persistent_jit(eval_step, name="compose.retrain_eval_step", identity=made))


def _retrain(cfg, space, net: N.Derived, ds, mesh, st, workdir, fp, resume, progress, history):
    r = cfg.retrain
    train_step, eval_step = retrain_steps(cfg, space, net)
    first = len(history)

    def end_epoch(rt, epoch, m):
        acc, _ = train.evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), ds.val, cfg.eval_batch_size,
                                mesh)
        row = {"epoch": first + epoch, "stage": "retrain", "train_loss": float(m["loss"]),
               "train_acc": float(m["acc"]), "val_acc": acc, "expected_latency_ms": None, "derived_latency_ms": None}
        tb.log(row["epoch"], tb.history_scalars(row))
        return row

    return loop.epochs(
        S.init_retrain_state(space, jax.device_get(st), net, float(r.lr)), cfg=cfg,
        ckpt=Checkpointer(os.path.join(workdir, "checkpoints", "retrain")), fp=fp, resume=resume, total=r.epochs,
        split=ds.train, batch_size=cfg.search.batch_size, seed=cfg.seed + 2,
        step=lambda rt, epoch, i, batch: train_step(rt, *train.shard_batch(batch, mesh)),
        place=lambda rt: train.replicate(rt, mesh), end_epoch=end_epoch, desc="retrain", progress=progress,
        postfix=lambda rt, m: {"loss": f"{float(m['loss']):.3f}", "acc": f"{float(m['acc']):.3f}"},
        extra_meta={"ops": list(net.ops), "weight_bits": list(net.weight_bits), "reductions": list(net.reductions),
                    "act_bits": list(net.act_bits)}, history=history)


def composed_entries(space, choices: Choices, config, net: N.Derived) -> dict:
    """result.json's ``compose`` entry: the configuration as ``jmsnas.compose.network.to_result`` records it (the
    reduction per link, 0 = none; bits per layer; bits per link; which devices quantize; what ``jmsnas export``
    reads back), the candidates searched, and every cut (link, boundary, module, channels sent of those there,
    transmitted bits)."""
    topo = space.topology
    shapes = boundary_shapes(space, True)
    cuts = []
    for l, (j, r, a) in enumerate(zip(net.bounds, net.reductions, net.act_bits)):
        c = shapes[j][1]
        tensor = "input" if j == input_boundary(space) else "stem" if j == 0 else f"layer {j - 1}"
        cuts.append({"link": topo.link_names[l], "boundary": int(j), "tensor": tensor,
                     "module": None if not r else {"reduction": int(r)},
                     "channels_sent": int(module_channels(c, r) if r else c), "channels": int(c),
                     "activation_bits": int(a)})
    stem = {"stem_device": topo.device_names[CN.stem_device(space, net.assignment)]} if choices.send_input else {}
    return {**CN.to_result(space, choices, config), **stem,
            "candidates": {"modules": list(choices.modules), "weight_bits": list(choices.weight_bits),
                           "activation_bits": list(choices.act_bits)}, "cuts": cuts}


def _finish(cfg, space, table, terms, choices, lim, ds, mesh, rt, net: N.Derived, fix, split, how, history, workdir):
    _, eval_step = retrain_steps(cfg, space, net)
    val_acc, test_acc = train.final_accuracy(eval_step, rt, ds, cfg.eval_batch_size, mesh)
    a = np.asarray(space.layer_devices() if split is None else split, np.int32)
    lat, mem, en = _costs(space, table, terms, lim.mem, onehot(space, choices, fix.config), a)
    lat = breakdown_dict(space, lat)
    as64 = lambda t: type(t)(*(np.asarray(x, np.float64) for x in t))
    train.fill_derived_latency(history, lat["total"])
    names = space.topology.device_names
    params = jax.device_get(rt.params)
    result = {
        "flow": "search", "topology": space.topology.name, "space": SP.to_dict(space),
        "t_const_ms": float(cfg.t_const_ms),
        "architecture": [{"layer": s.index, "device": names[int(d)], "op": OP_NAMES[i], "weight_bits": int(b)}
                         for s, i, d, b in zip(space.layers, net.ops, a, net.weight_bits)],
        "split": cfg.split, "compose": {**composed_entries(space, choices, fix.config, net), "split_chosen": how},
        "latency_ms": lat, "accuracy": {"val": val_acc, "test": test_acc},
        "params": supernet.count_params(params),
        "budget": {"met": bool(budget.within(lat["total"], cfg.t_const_ms)), "repaired": bool(fix.repaired),
                   "min_reachable_ms": float(fix.min_latency_ms), "note": _note(fix, cfg.t_const_ms)},
        "dataset": ds.name, "seed": cfg.seed,
        **L.format_report(space.topology, lim, as64(mem), as64(en)),
    }
    if timing.active() is not None:
        result["time"] = timing.summary()
    figures = directory.write_outputs(workdir, result, history,
                                      lambda: _write_parts(space, params, jax.device_get(rt.bn), net, workdir, a))
    if tb.active():
        tb.log(len(history), tb.result_scalars(result))
        tb.images(len(history), tb.figures(figures))
    return result


def _write_parts(space, params, bn, net: N.Derived, workdir: str, assignment) -> dict:
    """parts/ as the plain search writes them (``supernet.device_parts``: every device's layers, the stem with
    its device (the first unless the split sends the input), the head with the last), plus every cut's module: its ``reduce`` weights in the sender's part and
    its ``recover`` weights in the receiver's, under ``modules/<boundary>``; the manifest records every cut."""
    topo = space.topology
    compact = {k: v for k, v in params.items() if k != "modules"}
    layers_a = np.asarray(assignment)[:space.num_layers]
    parts = supernet.device_parts(space, compact, net.ops, layers_a)
    bn_parts = supernet.device_parts(space, bn, net.ops, layers_a)
    first, stem = topo.device_names[topo.path_order()[0]], topo.device_names[CN.stem_device(space, assignment)]
    for tree in (parts, bn_parts):  # the stem runs where the split puts it (the first device unless it sends the input)
        tree[stem]["params"]["stem"] = tree[first]["params"].pop("stem")
    out = {}
    for dev, part in parts.items():
        layers = part["layers"]
        out[dev] = {"params": part["params"], "bn": bn_parts[dev]["params"], "layers": layers, "ops": part["ops"],
                    "input_shape": None if not layers else [space.layers[layers[0]].in_hw] * 2
                    + [space.layers[layers[0]].in_ch],
                    "output_shape": None if not layers else [space.layers[layers[-1]].out_hw] * 2
                    + [space.layers[layers[-1]].out_ch]}
    for l, (j, r) in enumerate(zip(net.bounds, net.reductions)):
        if not r:
            continue
        link = topo.links[l]
        p = params["modules"][str(j)]
        for end, key in ((link.src, "reduce"), (link.dst, "recover")):
            out[end]["params"].setdefault("modules", {}).setdefault(str(j), {})[key] = p[key]
    cuts = [{"link": topo.link_names[l], "boundary": int(j), "reduction": int(r), "activation_bits": int(b)}
            for l, (j, r, b) in enumerate(zip(net.bounds, net.reductions, net.act_bits))]
    return directory.write_parts(workdir, out, {"op_names": list(OP_NAMES), "space": SP.to_dict(space),
                                                "weight_bits": list(net.weight_bits), "cuts": cuts})


def _costs_impl(space, table, terms, mem, probs, a):
    return (K.latency(space, table, terms, probs, a), K.memory(space, mem, table, terms, probs, a),
            K.energy(space, table, terms, probs, a))


_costs = jax.jit(_costs_impl, static_argnums=0)  # one executable instead of a few hundred small ones


def _note(fix, t_const) -> str:
    if not fix.feasible:
        return (f"no configuration of the composed space meets T_const={t_const:.4g} ms; the fastest reachable is "
                f"{fix.min_latency_ms:.4g} ms and is used")
    if fix.repaired:
        return (f"the derived configuration exceeded T_const or a device's limit; repaired to the most probable one "
                f"within them (log-probability loss {fix.logprob_loss:.3f})")
    return "the derived (argmax) configuration meets T_const"
