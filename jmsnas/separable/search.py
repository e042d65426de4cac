"""The separable-network run (paper 004, section 3.2, Fig. 2): alternate training the network on sampled
decisions (eq. (9), Monte Carlo over ``decisions_per_step`` samples) and training the controller on validation
accuracy (minus ``comm_cost`` x transmitted bytes relative to the non-separated network); each round ends by
sampling ``final_samples`` decisions and keeping the best one with its weights; then fine-tune the best.

The random sampler of section 4.5 runs in the same run as a second arm: the same initial network, the same
batches, the same number of network, reward and sample evaluations, decisions drawn uniformly. Section 4.5's
control group (a random sampler on the network the controller trained) is measured at every controller step:
as many uniformly drawn decisions as the controller's, on the controller arm's weights and the same validation
data (``random_on_controller_weights``; evaluated only, so it changes nothing else in the run). Optionally the
non-separated network (``reference``) is trained for the same number of steps.

Every round ends with a checkpoint (both arms, the reference, the history); ``resume=True`` continues from the
latest one. Keys and batches are pure functions of (seed, round, step), so a resumed run ends as an uninterrupted
one does.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jmsnas import data, timing, train
from jmsnas import tensorboard as tb
from jmsnas.checkpoint import Checkpointer
from jmsnas.run import directory, loop
from jmsnas.run import workdir as W
from jmsnas.separable import config as sconfig, cost, decisions as dec, network as net, plots
from jmsnas.separable.controller import ask_many, make_controller, make_random
from jmsnas.separable.parts import write_parts
from jmsnas.strategies.base import Strategy, sample_valid
from jmsnas.topology import DeviceProfile, LinkProfile, TopologyError, cluster

ARMS = ("controller", "random")


# ------------------------------------------------------------------------------------------------- building

def build_spec(cfg, ds, reference: bool = False) -> net.NetSpec:
    """The network of ``cfg.net`` on ``ds``'s images (``reference``: the non-separated one)."""
    return net.make_spec(image_size=ds.image_size, in_channels=ds.channels, num_classes=ds.num_classes,
                         reference=reference, **cfg.net)


def _per(name: str, value, count: int) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise TopologyError(f"cluster.{name} lists {len(values)} values {values}, expected {count} (one per device)")
    return values


def build_cluster(cfg):
    """The cluster topology of the config: the file ``cluster.topology`` if given, else ``num_devices`` (default G)
    devices from the config's numbers with a link between every ordered pair."""
    c = cfg.cluster
    if c.get("topology"):  # a topology file whose links join every ordered pair of devices
        from jmsnas.topology import load
        topo = load(c.topology)
        if topo.kind != "cluster":
            raise TopologyError(f"cluster.topology {c.topology!r} is a {topo.kind!r} topology; a separable network "
                                f"needs a link between every ordered pair of its devices")
        return topo
    m = cfg.net.num_groups if c.num_devices is None else c.num_devices  # config.BOUNDS: an integer >= 2
    gflops = _per("peak_gflops", c.peak_gflops, m)
    devices = [DeviceProfile(f"node{i}", gflops[i], 1e9, efficiency=c.efficiency,
                             note="Raspberry Pi 3B+ class (paper 004, section 4.6)") for i in range(m)]
    rows = [_per(f"bandwidth_mbps[{i}]", r, m) for i, r in enumerate(_per("bandwidth_mbps", c.bandwidth_mbps, m))]
    links = [LinkProfile(f"node{i}", f"node{j}", rows[i][j], c.link_latency_ms)
             for i in range(m) for j in range(m) if j != i]
    return cluster(f"cluster{m}", devices, links)


# ----------------------------------------------------------------------------------------- jitted functions

def make_fns(spec: net.NetSpec):
    """(opt, step, correct) for ``spec``: Adam with the learning rate as an argument of ``step`` (one compiled
    program for training and fine-tuning); decisions are int32[M, S] (None for the reference network)."""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    def losses(params, x, y, pids, lvls):
        logits = net.apply(spec, params, x, pids, lvls)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce, jnp.mean(jnp.argmax(logits, -1) == y)

    def loss_fn(params, x, y, pids, lvls):
        if pids is None:
            return losses(params, x, y, None, None)
        ce, acc = jax.vmap(lambda p, l: losses(params, x, y, p, l))(pids, lvls)
        return ce.mean(), acc.mean()

    @jax.jit
    def step(params, opt_state, lr, x, y, pids, lvls):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, pids, lvls)
        opt_state.hyperparams["learning_rate"] = lr
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, acc

    @jax.jit
    def correct(params, x, y, valid, pids, lvls):
        """float32[P] correct predictions among the ``valid`` rows of the batch for each decision sequence."""
        hit = lambda p, l: jnp.sum((jnp.argmax(net.apply(spec, params, x, p, l), -1) == y) * valid)
        if pids is None:
            return hit(None, None)[None]
        return jax.vmap(hit)(pids, lvls)

    return opt, step, correct


def accuracy(correct, params, split: data.Split, batch: int, pids=None, lvls=None) -> np.ndarray:
    """float64[P] accuracy of each decision sequence on a whole split (batches padded to ``batch`` rows, so one
    compiled program serves every split)."""
    hits = sum(np.asarray(correct(params, x, y, valid, pids, lvls)) for x, y, valid in
               train.padded_eval_batches(split, batch))
    return hits / split.labels.shape[0]


def shift_images(images: np.ndarray, shift: int, rng: np.random.Generator) -> np.ndarray:
    """Each image [B, H, W, C] moved by its own (dy, dx) drawn uniformly from [-shift, shift]², edges repeated."""
    if shift == 0:
        return images
    b, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (shift, shift), (shift, shift), (0, 0)), mode="edge")
    dy, dx = rng.integers(0, 2 * shift + 1, size=(2, b))
    rows = dy[:, None] + np.arange(h)[None, :]
    cols = dx[:, None] + np.arange(w)[None, :]
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _batch(ds, cfg, step: int):
    """Training batch ``step`` (a pure function of seed and step: every arm sees the same images)."""
    nb = data.num_batches(ds.train, cfg.search.batch_size)
    x, y = next(data.epoch_batches(ds.train, cfg.search.batch_size, seed=cfg.seed, epoch=step // nb, start=step % nb))
    shift = cfg.search.get("augment_shift", 0)
    return shift_images(x, shift, np.random.default_rng([int(cfg.seed), int(step), 7])) if shift else x, y


# ---------------------------------------------------------------------------------------------------- the run

class Run:
    """Everything fixed for one run: data, specs, cluster, strategies, jitted functions."""

    def __init__(self, cfg, ds, spec, ref_spec, topo):
        s = cfg.search
        self.cfg, self.ds, self.spec, self.ref_spec, self.topo = cfg, ds, spec, ref_spec, topo
        self.space = spec.decision_space()
        strategies = {"controller": make_controller(self.space, population=s.population, learning_rate=s.ctrl_lr,
                                                    hidden=s.hidden, entropy_coef=s.entropy_coef,
                                                    baseline_decay=s.get("baseline_decay", 0.0)),
                      "random": make_random(self.space, population=s.population)}
        # jitted: eager ask/tell would compile every small op of the policy update separately
        self.strategies = {a: Strategy(*(jax.jit(f) for f in st)) for a, st in strategies.items()}
        self.opt, self.step, self.correct = make_fns(spec)
        mask = jnp.asarray(self.space.mask())
        self.uniform = jax.jit(lambda key: sample_valid(key, mask, s.population))  # the control group's draws
        self.ref_opt, self.ref_step, self.ref_correct = make_fns(ref_spec)
        self.lr, self.ft_lr = jnp.float32(s.lr), jnp.float32(s.finetune_lr)
        self.ref_bytes = cost.reference_bytes(spec)

    def init_state(self) -> dict:
        key = jax.random.PRNGKey(self.cfg.seed)
        k_net, k_ctrl, k_ref = jax.random.split(key, 3)
        params = net.init(k_net, self.spec)  # the same initial network for both arms
        tokens = self.space.mask().shape[0]
        arms = {a: {"params": params, "opt": jax.jit(self.opt.init)(params), "strategy": self.strategies[a].init(k_ctrl),
                    "best_params": params, "best_acc": jnp.asarray(-1.0, jnp.float32),
                    "best_tokens": jnp.zeros((tokens,), jnp.int32)} for a in ARMS}
        ref = net.init(k_ref, self.ref_spec)
        return {"arms": arms, "ref": {"params": ref, "opt": jax.jit(self.ref_opt.init)(ref)}}

    def decode(self, tokens) -> tuple:
        return tuple(jnp.asarray(a) for a in self.space.decode(np.asarray(tokens)))

    def ratio(self, tokens) -> np.ndarray:
        p, l = self.space.decode(np.asarray(tokens))
        return np.array([cost.bytes_per_image(self.spec, a, b) for a, b in zip(p, l)]) / self.ref_bytes

    def acc(self, params, tokens, split=None) -> np.ndarray:
        """float64[n] accuracy of n decision sequences (tokens int[n, T]) on ``split`` (default val), evaluated
        in chunks of the population size P (one compiled program)."""
        split = self.ds.val if split is None else split
        tokens, pop = np.asarray(tokens), self.cfg.search.population
        n = tokens.shape[0]
        padded = np.concatenate([tokens, np.repeat(tokens[-1:], -n % pop, 0)])  # the last one repeated
        return np.concatenate([accuracy(self.correct, params, split, self.cfg.eval_batch_size,
                                        *self.decode(padded[i:i + pop])) for i in range(0, n, pop)])[:n]

    def control_reward(self, params, r: int, t: int) -> np.ndarray:
        """Rewards of ``population`` uniformly drawn decisions on ``params`` (validation data): section 4.5's
        control group at controller step t of round r. Its keys are a stream of their own, so measuring it leaves
        every other draw of the run as it was."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed + 2), r), t)
        return self.reward(params, np.asarray(self.uniform(key)))

    def reward(self, params, tokens) -> np.ndarray:
        """float64[n]: validation accuracy minus ``comm_cost`` x bytes relative to the non-separated network."""
        return self.acc(params, tokens) - self.cfg.search.comm_cost * self.ratio(tokens)

    def train(self, step, params, opt_state, lr, first: int, n: int, decide=lambda t: (None, None)):
        """``n`` steps of ``step`` (``make_fns``) on the training batches ``first``, ``first + 1``, ... (the same for
        every arm and the reference); ``decide(t)``: the decisions (perm_ids, levels) of step t, None for the
        reference network. Returns (params, opt_state, the loss of each step)."""
        losses = []
        for t in range(n):
            x, y = _batch(self.ds, self.cfg, first + t)
            params, opt_state, loss, _ = step(params, opt_state, lr, x, y, *decide(t))
            losses.append(loss)
        return params, opt_state, losses

    def round(self, state: dict, r: int) -> tuple[dict, dict]:
        """One round for both arms and the reference; returns (state, history entry)."""
        s = self.cfg.search
        key = jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed + 1), r)
        entry = {"round": r}
        for arm in ARMS:
            st, strat = dict(state["arms"][arm]), self.strategies[arm]
            k_net, k_ctrl, k_samp = jax.random.split(key, 3)
            sampled = lambda t: self.decode(ask_many(strat, jax.random.fold_in(k_net, t), st["strategy"],
                                                     -(-s.decisions_per_step // s.population))[:s.decisions_per_step])
            st["params"], st["opt"], losses = self.train(self.step, st["params"], st["opt"], self.lr,
                                                         r * s.net_steps, s.net_steps, sampled)
            rewards, control = [], []
            for t in range(s.ctrl_steps):
                ka, kt = jax.random.split(jax.random.fold_in(k_ctrl, t))
                archs, st["strategy"] = strat.ask(ka, st["strategy"])
                reward = self.reward(st["params"], archs.ops)
                st["strategy"], _ = strat.tell(kt, archs, jnp.asarray(reward, jnp.float32), st["strategy"])
                rewards.append(float(np.mean(reward)))
                if arm == "controller":  # the control group: uniform decisions judged on the same weights and data
                    control.append(float(np.mean(self.control_reward(st["params"], r, t))))
            toks = ask_many(strat, k_samp, st["strategy"], -(-s.final_samples // s.population))[:s.final_samples]
            acc = self.acc(st["params"], toks)
            i = int(np.argmax(acc))
            if acc[i] > float(st["best_acc"]):
                st["best_acc"], st["best_tokens"] = jnp.asarray(acc[i], jnp.float32), jnp.asarray(toks[i])
                st["best_params"] = st["params"]
            entry[arm] = {"train_loss": float(np.mean([float(v) for v in losses])), "rewards": rewards,
                          "sample_acc": acc.tolist(), "sample_bytes_ratio": self.ratio(toks).tolist(),
                          "best_acc": float(st["best_acc"]),
                          **({"random_on_controller_weights": control} if arm == "controller" else {})}
            state["arms"][arm] = st
        if self.cfg.reference:
            ref = dict(state["ref"])
            ref["params"], ref["opt"], _ = self.train(self.ref_step, ref["params"], ref["opt"], self.lr,
                                                      r * s.net_steps, s.net_steps)
            state["ref"] = ref
        return state, entry

    def scores(self, params, tokens, perm_ids, levels) -> dict:
        """Validation and test accuracy of one decision sequence (tokens int[1, T]) on ``params``, and its cost."""
        acc = lambda split: float(self.acc(params, tokens, split)[0])
        return {"val_acc": acc(self.ds.val), "test_acc": acc(self.ds.test),
                "cost": cost.evaluate(self.spec, self.topo, perm_ids, levels, self.cfg.cluster.input_device)}

    def finish(self, state: dict) -> tuple:
        """Fine-tune the best decision of each arm (and the reference) and measure test accuracy and costs;
        returns (result entries, {arm: (fine-tuned params, perm_ids int[S], levels int[S])})."""
        s, out, final = self.cfg.search, {}, {}
        first, table = s.rounds * s.net_steps, dec.permutation_table(self.spec.num_groups)
        for arm in ARMS:
            st = state["arms"][arm]
            tokens = np.asarray(st["best_tokens"])[None]
            p, l = self.decode(tokens)
            params = self.train(self.step, st["best_params"], jax.jit(self.opt.init)(st["best_params"]), self.ft_lr,
                                first, s.finetune_steps, lambda t: (p, l))[0]
            pid, lv = np.asarray(p[0]), np.asarray(l[0])
            final[arm] = (params, pid, lv)
            out[arm] = {
                "decisions": {"perm_ids": pid.tolist(), "permutations": table[pid].tolist(), "levels": lv.tolist(),
                              "send_percent": [float(dec.send_fraction(int(v), self.spec.num_levels,
                                                                       self.spec.p_min) * 100) for v in lv],
                              "intensive": [dec.is_intensive(table[i]) for i in pid]},
                "search_val_acc": float(st["best_acc"]), **self.scores(params, tokens, pid, lv)}
        if self.cfg.get("decisions") is not None:  # the user's decision sequence, on the controller arm's weights
            pid, lv = dec.from_permutations(self.space, self.cfg.decisions, self.cfg.get("levels"))
            out["given"] = {"decisions": {"perm_ids": pid.tolist(), "levels": lv.tolist()},
                            **self.scores(state["arms"]["controller"]["best_params"],
                                          self.space.encode(pid[None], lv[None]), pid, lv)}
        if self.cfg.reference:
            ref = state["ref"]["params"]
            ref = self.train(self.ref_step, ref, jax.jit(self.ref_opt.init)(ref), self.ft_lr, first, s.finetune_steps)[0]
            acc = lambda split: float(accuracy(self.ref_correct, ref, split, self.cfg.eval_batch_size)[0])
            out["reference"] = {"test_acc": acc(self.ds.test), "val_acc": acc(self.ds.val),
                                "bytes_per_image": self.ref_bytes, "num_params": net.num_params(ref)}
        return out, final


def prepare(cfg, workdir: str, resume: bool):
    """Validates everything and builds the run before the workdir is touched; returns (Run, cfg)."""
    cfg = sconfig.default_config() if cfg is None else ml_collections.ConfigDict(cfg.to_dict())
    sconfig.validate(cfg)
    ds = data.from_config(cfg)
    spec = build_spec(cfg, ds)
    topo = build_cluster(cfg)
    cost.check_cluster(spec, topo, cfg.cluster.input_device)
    if cfg.get("decisions") is not None:
        dec.from_permutations(spec.decision_space(), cfg.decisions, cfg.get("levels"))
    data.num_batches(ds.train, cfg.search.batch_size)  # batch size fits the split
    W.check_and_claim(workdir, resume, cfg, "separable")
    return Run(cfg, ds, spec, build_spec(cfg, ds, reference=True), topo), cfg


@timing.measured
def search(cfg, workdir: str, *, resume: bool = False, progress: bool = True) -> dict:
    """Runs the rounds on the run layer's generation loop (a checkpoint after each), fine-tunes, writes parts/, the
    plots, history.json and result.json (atomically, process 0); returns the result."""
    run, cfg = prepare(cfg, workdir, resume)
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", bool(cfg.get("fast_compile", False)) or before)
    try:
        with tb.run(workdir, tb.enabled(cfg)):
            ckpt = Checkpointer(os.path.join(workdir, "checkpoints", "separable"))
            state, carry = loop.generations(run.init_state(), ckpt=ckpt, fp=W.fingerprint(cfg), resume=resume,
                                            total=cfg.search.rounds, generation=lambda *a: _round(run, *a),
                                            carry={"history": []}, desc="separable rounds", progress=progress,
                                            unit="round")
            ckpt.close()
            return _write(cfg, run, state, carry["history"], workdir)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def _round(run: Run, state: dict, r: int, carry: dict) -> tuple:
    """Round r (``Run.round``) logged to TensorBoard, its entry appended to the history."""
    state, entry = run.round(state, r)
    per_round, per_step = tb.separable_round_scalars(entry, run.cfg.search.ctrl_steps)
    for step, scalars in [(r, per_round), *per_step]:
        tb.log(step, scalars)
    return state, {"history": carry["history"] + [entry]}


def _write(cfg, run: Run, state: dict, history: list, workdir: str) -> dict:
    out, final = run.finish(state)
    result = _result(cfg, run, out, history)
    # the controller arm's fine-tuned network, per device (what jmsnas export deploys: jmsnas.deploy.separable)
    write_parts(workdir, run.spec, *final["controller"], run.topo, cfg.cluster.input_device)
    paths = plots.write(result, history, workdir)
    result["plots"] = [os.path.basename(p) for p in paths]  # in the workdir
    if timing.active() is not None:  # compile and run time (wall, CPU): the only entry that varies by run
        result["time"] = timing.summary()
    directory.write_json(workdir, directory.HISTORY, history)
    directory.write_json(workdir, directory.RESULT, result)
    tb.log(len(history), tb.separable_result_scalars(result))
    tb.images(len(history), tb.figures(paths))
    return result


def reward_summary(history) -> dict:
    """Mean validation reward per arm over all controller steps and over the last round's steps, and the same for
    the control group (uniform decisions on the controller arm's weights, ``random_on_controller_weights``)."""
    def means(arm: str, key: str) -> dict:
        return {"mean_reward": float(np.mean([v for h in history for v in h[arm][key]])),
                "last_round_mean_reward": float(np.mean(history[-1][arm][key]))}

    out = {arm: {**means(arm, "rewards"), "last_round_mean_sample_acc": float(np.mean(history[-1][arm]["sample_acc"]))}
           for arm in ARMS}
    if all("random_on_controller_weights" in h["controller"] for h in history):
        out["random_on_controller_weights"] = means("controller", "random_on_controller_weights")
    return out


def _result(cfg, run: Run, out: dict, history) -> dict:
    spec, s = run.spec, cfg.search
    evals = s.rounds * (s.ctrl_steps * s.population + s.final_samples)
    return {"flow": "separable", "topology": run.topo.name, "dataset": cfg.dataset, "seed": cfg.seed,
            "config": cfg.to_dict(),
            "network": {"G": spec.num_groups, "alpha": spec.alpha, "K": spec.num_levels, "p_min": spec.p_min,
                        "float16": spec.float16, "blocks": spec.num_blocks, "steps": spec.num_steps,
                        "search_space_size": float(math.factorial(spec.num_groups) ** spec.num_steps
                                                   * spec.num_levels ** spec.num_steps),
                        "num_params": net.num_params(jax.eval_shape(lambda k: net.init(k, spec), jax.random.PRNGKey(0)))},
            "cluster": {"name": run.topo.name, "devices": list(run.topo.device_names),
                         "links": list(run.topo.link_names), "input_device": cfg.cluster.input_device,
                         "output_device": run.topo.device_names[spec.output_group]},
            "decision_evaluations_per_arm": evals, "reward_summary": reward_summary(history), **out}
