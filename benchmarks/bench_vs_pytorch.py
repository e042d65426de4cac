"""The jmsnas supernet against the same supernet in PyTorch on this CPU: images/s per gate mode and step.

Usage:
  python benchmarks/bench_vs_pytorch.py [--reps 5] [--batch 64] [--threads 2] [--modes ...] [--xla-vector-width 512]
      [--layers-per-device 2 2 2 2] [--memory]

``--layers-per-device 5 5 5 5`` is the CIFAR-sized space of ``experiments/configs/cifar_chain.py`` (20 searchable
layers, the same widths and strides). ``--memory`` adds peak host memory per mode and side: three fresh processes
import both libraries and build both sides' models and data alike; one then runs JAX's steps (compile, warm-up and
two repetitions), one PyTorch's, one neither. The table gives each process's peak resident set (``VmHWM``) above
that of the process that ran neither, so JAX's figure includes what XLA's compiler takes and PyTorch's the code
its kernels page in: what a user's process pays for the step.

Workload (the same on both sides): the 8-layer chain space of ``jmsnas.presets.chain_preset((2, 2, 2, 2))`` at
32x32x3 input, 10 classes, device channels (32, 48, 64, 96), strides (1, 2, 2, 1), stem 16 ch, head 128 ch;
layers 0/2/4/6 change shape (6 MBConv candidates: k 3/5/7 x expansion 3/6), layers 1/3/5/7 keep it (13: also
the shortcut variants and identity). Weights shared per layer (a superkernel; candidates slice it) on both sides,
batch norm per candidate. Adam on both sides; L2 lambda1 = 1e-5 (torch: Adam weight_decay = 2 * lambda1,
the same gradient).

Rows: two-path gates (weight step: one sampled path per layer; arch step: two sampled paths, eq. (5) gradient,
latency term, Adam on alpha), Gumbel-softmax and the softmax mixture (every valid path weighted; a weight step and
an arch step, which forms no weight gradients), and one derived network (forward in eval mode, train step). The
sampled paths are the ones jmsnas's steps draw (its PRNG key chain replayed), handed to PyTorch, so every
repetition does the same work on both sides. A repetition is ``steps`` consecutive steps; images/s = batch *
steps / seconds; the median of ``--reps`` repetitions after warm-up, JAX and PyTorch repetitions interleaved so
that load from other processes hits both alike.

FLOPs are counted analytically (``jmsnas.space.op_flops`` + stem + head, 2 per multiply-add, convolutions only):
x3 for a weight step (forward, input and weight gradients), x2 for an arch step (forward and input gradients),
x1 for a forward. They are the useful FLOPs of the sampled candidates, the work PyTorch does.

XLA flags must be set before jax is imported: ``--xla-vector-width`` sets ``--xla_cpu_prefer_vector_width``.
``--allocator``: ``default`` runs jmsnas as the command runs it (``jmsnas.hostmem.apply``, i.e. ``keep_step_memory``: steps on the
calling thread, large blocks kept in its untrimmed heap; one process, so PyTorch's main-thread allocations share
that heap setting); ``off`` is ``JMSNAS_KEEP_FREED_MEMORY=0`` (glibc and JAX's dispatch left as they are);
``keep`` is ``JMSNAS_KEEP_FREED_MEMORY=1`` (one untrimmed heap for every thread). Page faults per step are printed
for each side.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time


def _early_flags() -> None:
    """Apply --xla-vector-width to XLA_FLAGS and the allocator choice before jax (or torch) is imported."""
    if "--xla-vector-width" in sys.argv:
        width = sys.argv[sys.argv.index("--xla-vector-width") + 1]
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_prefer_vector_width={width}").strip()
    if "--allocator" in sys.argv:
        choice = sys.argv[sys.argv.index("--allocator") + 1]
        setting = {"off": "0", "keep": "1"}.get(choice)
        if setting is not None:
            os.environ["JMSNAS_KEEP_FREED_MEMORY"] = setting


_early_flags()

import jmsnas.hostmem  # noqa: E402

jmsnas.hostmem.apply()  # first, as the jmsnas command does: JMSNAS_KEEP_FREED_MEMORY's setting before JAX allocates

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_supernet as TS  # noqa: E402
from bench_dwconv import median_seconds  # noqa: E402

from jmsnas import gates as G  # noqa: E402
from jmsnas import hostmem  # noqa: E402
from jmsnas import supernet, train  # noqa: E402
from jmsnas.topology import presets
from jmsnas.cost.latency import expected_latency  # noqa: E402
from jmsnas.cost.tables import analytic_table, head_flops, stem_flops  # noqa: E402
from jmsnas.objectives import cross_entropy, l2_norm_sq  # noqa: E402
from jmsnas.space import NUM_OPS, OPS, build_space, op_flops, op_index  # noqa: E402

DERIVED = ("mbconv_k3_e6", "mbconv_k5_e3_res", "mbconv_k5_e6", "mbconv_k3_e6_res",
           "mbconv_k7_e6", "mbconv_k5_e6_res", "mbconv_k3_e6", "mbconv_k7_e3_res")
MODES = ("two_path_weight", "two_path_arch", "gumbel_weight", "gumbel_arch", "softmax_weight", "softmax_arch",
         "derived_forward", "derived_train")


def bench_space(layers_per_device=(2, 2, 2, 2)):
    """The benchmark's space; ``layers_per_device`` (5, 5, 5, 5) is experiments/configs/cifar_chain.py's space."""
    return build_space(presets.chain_preset(tuple(layers_per_device)), image_size=32, in_channels=3,
                       num_classes=10, device_channels=(32, 48, 64, 96), device_strides=(1, 2, 2, 1))


def derived_ops(space) -> tuple:
    """The derived network's op names: ``DERIVED`` on the 8-layer space; on any other depth, kernels 3/5/7 and
    expansions 6/3 in turn, shortcut variants on the layers that keep their shape."""
    if space.num_layers == len(DERIVED) and all(
            s.keeps_shape == name.endswith("_res") for s, name in zip(space.layers, DERIVED)):
        return DERIVED
    return tuple(f"mbconv_k{(3, 5, 7)[n % 3]}_e{(6, 3)[n % 2]}" + ("_res" if s.keeps_shape else "")
                 for n, s in enumerate(space.layers))


# ----- FLOPs -----

def layer_flops(space, n: int, ops) -> float:
    return sum(op_flops(OPS[int(i)], space.layers[n]) for i in ops)


def forward_flops(space, paths) -> float:
    """Forward FLOPs per image when layer n computes the candidates paths[n] (a list of op indices)."""
    return stem_flops(space) + head_flops(space) + sum(layer_flops(space, n, p) for n, p in enumerate(paths))


def all_valid(space):
    return [list(np.flatnonzero(space.mask()[n])) for n in range(space.num_layers)]


def minor_faults() -> int:
    """Minor page faults of this process so far (first touches of freshly mapped memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def torch_sync(device: str) -> None:
    """Wait for PyTorch's queued GPU work (timings on CUDA end when the work ends); nothing on the CPU."""
    if device != "cpu":
        torch.cuda.synchronize()


def matmul_peak(reps: int, n: int = 2048, device: str = "cpu") -> tuple:
    """fp32 GFLOP/s of an n x n matmul: (jax, torch), median of reps."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    tj = median_seconds(lambda: jax.block_until_ready(f(a)), reps, warmup=1)
    at = torch.from_numpy(np.asarray(a)).to(device)
    tt = median_seconds(lambda: (torch.mm(at, at), torch_sync(device)), reps, warmup=1)
    return 2 * n ** 3 / tj / 1e9, 2 * n ** 3 / tt / 1e9


# ----- replaying jmsnas's samples -----

def replay_single_paths(key, alpha, mask, steps: int):
    """The paths weight_step samples in its next ``steps`` calls from a state whose key is ``key``."""
    sample = jax.jit(lambda k: G.single_path_gates(k, alpha, mask).paths)
    out = []
    for _ in range(steps):
        key, k = jax.random.split(key)
        out.append(np.asarray(sample(k)))
    return out


def replay_two_paths(key, alpha, mask, steps: int):
    """(paths int[N, 2], active int[N]) that arch_step draws (at alpha = its initial value) in its next steps."""
    def draw(k):
        g = G.two_path_gates(k, alpha, mask)
        chosen = jnp.argmax(g.weights, -1)
        return g.paths, (g.paths[:, 1] == chosen).astype(jnp.int32)

    draw = jax.jit(draw)
    out = []
    for _ in range(steps):
        key, k = jax.random.split(key)
        p, a = draw(k)
        out.append((np.asarray(p), np.asarray(a)))
    return out


# ----- the JAX side -----

def mixture_weight_step(space, hp, mode: str, dw_impl: str, candidate_impl: str = "auto"):
    """A weight step with every valid path weighted (Gumbel-softmax or softmax gates), as jmsnas's weight step."""
    mask = jnp.asarray(space.mask())
    tx = optax.adam(hp.weight_lr)
    tau_at = G.temperature_schedule(hp.tau0, hp.tau_min, hp.tau_decay)

    def step(st, x, y):
        key, k = jax.random.split(st.key)
        gates = (G.gumbel_softmax_gates(k, st.alpha, mask, tau_at(st.step)) if mode == "gumbel"
                 else G.softmax_gates(st.alpha, mask))

        def loss_fn(params):
            logits, bn = supernet.apply(space, params, st.bn, gates, x, train=True, dw_impl=dw_impl,
                                        impl=candidate_impl)
            ce = cross_entropy(logits, y)
            return ce + hp.lambda1 * l2_norm_sq(params), bn

        (loss, bn), grads = jax.value_and_grad(loss_fn, has_aux=True)(st.params)
        updates, opt = tx.update(grads, st.weight_opt, st.params)
        return st._replace(params=optax.apply_updates(st.params, updates), bn=bn, weight_opt=opt, key=key,
                           step=st.step + 1), loss

    return jax.jit(step, donate_argnums=0)


class JaxRunner:
    """Runs ``steps`` steps of a jitted (state, x, y) -> (state, out) function, blocking at the end."""

    def __init__(self, step, state, x, y):
        self.step, self.state, self.x, self.y = step, state, x, y

    def __call__(self, steps: int):
        out = None
        for _ in range(steps):
            self.state, out = self.step(self.state, self.x, self.y)
        jax.block_until_ready((self.state, out))


# ----- the runs -----

def build_mode(mode, args, space, data):
    """(jax_run(rep_index), torch_run(rep_index), flops_per_image(rep_index), steps, description)."""
    hp = train.SearchHParams(gate_mode={"two_path": "two_path", "gumbel": "gumbel_soft",
                                        "softmax": "softmax"}.get(mode.split("_")[0], "two_path"))
    mask = space.mask()
    x, y, xt, yt = data
    key = jax.random.PRNGKey(0)
    steps = args.steps_sampled if mode.startswith("two_path") or mode.startswith("derived") else args.steps_mixture
    total = steps * (args.reps + args.warmup + 1)
    idx = lambda r: range((r + 1) * steps, (r + 2) * steps)  # JAX's steps in repetition r (r = -1: compile)
    torch.manual_seed(0)

    if mode.startswith("derived"):
        ops = tuple(op_index(o) for o in derived_ops(space))
        st = train.init_search_state(key, space, hp)
        rt = train.init_retrain_state(space, st, ops, 1e-3)
        train_step, eval_step = train.make_retrain_steps(space, ops, 1e-3, hp.lambda1, args.dw_impl)
        net = TS.compact_net(space, ops).to(args.torch_device, memory_format=args.fmt)
        fl = forward_flops(space, [[i] for i in ops])
        if mode == "derived_forward":
            valid = jnp.ones((x.shape[0],), jnp.float32)
            net.eval()

            def jrun(r):
                for _ in range(steps):
                    out = eval_step(rt.params, rt.bn, x, y, valid)
                jax.block_until_ready(out)

            def trun(r):
                for _ in range(steps):
                    TS.compact_eval(net, xt, yt)

            return jrun, trun, lambda r: fl, steps, "eval-mode forward of the derived network"
        opt = torch.optim.Adam(net.parameters(), 1e-3, weight_decay=2 * hp.lambda1)
        run = JaxRunner(train_step, rt, x, y)
        trun = lambda r: [TS.compact_train_step(net, opt, xt, yt) for _ in range(steps)]
        return lambda r: run(steps), trun, lambda r: 3 * fl, steps, "train step of the derived network"

    st = train.init_search_state(key, space, hp)
    table = analytic_table(space)
    weight_step, arch_step, _ = train.make_search_steps(space, table, hp, args.dw_impl, args.candidate_impl)
    model = TS.Supernet(space).to(args.torch_device, memory_format=args.fmt)
    w_opt = torch.optim.Adam(model.parameters(), hp.weight_lr, weight_decay=2 * hp.lambda1)
    alpha_t = torch.zeros(space.num_layers, NUM_OPS, requires_grad=True, device=args.torch_device)
    a_opt = torch.optim.Adam([alpha_t], hp.arch_lr)
    dev = space.layer_devices()
    per_layer = np.asarray(table.compute_ms)[dev, np.arange(space.num_layers)]
    p0 = np.asarray(G.probabilities(st.alpha, jnp.asarray(mask)))
    const = float(expected_latency(space, table, st.alpha).total) - float((p0 * per_layer).sum())
    lat = TS.LatencyTerm(mask, per_layer, const, hp.t_const_ms, hp.lambda2, device=args.torch_device)
    alpha0 = st.alpha
    gates_t = torch.ones(space.num_layers, NUM_OPS, device=args.torch_device)

    if mode == "two_path_weight":
        seq = replay_single_paths(st.key, alpha0, jnp.asarray(mask), total)
        run = JaxRunner(weight_step, st, x, y)
        trun = lambda r: [TS.sampled_weight_step(model, w_opt, xt, yt, gates_t, seq[s].tolist())
                          for s in idx(r)]
        fl = lambda r: 3 * np.mean([forward_flops(space, seq[s].tolist()) for s in idx(r)])
        return lambda r: run(steps), trun, fl, steps, "1 sampled path per layer, weight gradients, Adam"
    if mode == "two_path_arch":
        seq = replay_two_paths(st.key, alpha0, jnp.asarray(mask), total)
        run = JaxRunner(arch_step, st, x, y)
        trun = lambda r: [TS.two_path_arch_step(model, alpha_t, a_opt, xt, yt, seq[s][0].tolist(), seq[s][1], lat)
                          for s in idx(r)]
        fl = lambda r: 2 * np.mean([forward_flops(space, seq[s][0].tolist())
                                    for s in idx(r)])
        return lambda r: run(steps), trun, fl, steps, "2 sampled paths per layer, eq. (5) alpha gradient, Adam"
    fl_all = forward_flops(space, all_valid(space))
    kind = mode.split("_")[0]
    tau = hp.tau0 if kind == "gumbel" else None
    if mode.endswith("weight"):
        step = mixture_weight_step(space, hp, kind, args.dw_impl, args.candidate_impl)
        run = JaxRunner(step, st, x, y)

        def trun(r):
            for _ in range(steps):
                with torch.no_grad():
                    logits = alpha_t if tau is None else (
                        alpha_t - torch.log(-torch.log(torch.rand_like(alpha_t)))) / tau
                    g = lat.probabilities(logits)
                TS.mixture_weight_step(model, w_opt, xt, yt, g)

        return lambda r: run(steps), trun, lambda r: 3 * fl_all, steps, "all valid paths weighted, weight gradients"
    run = JaxRunner(arch_step, st, x, y)
    trun = lambda r: [TS.mixture_arch_step(model, alpha_t, a_opt, xt, yt, lat, tau) for _ in range(steps)]
    return lambda r: run(steps), trun, lambda r: 2 * fl_all, steps, "all valid paths weighted, alpha gradient"


def check_reference(space, batch: int = 4) -> float:
    """Max |logit difference| between jmsnas and the torch reference (exact padding, eval mode, on the CPU) on one
    random batch, over the full mixture and one sampled path per layer; raises if it exceeds float32 round-off.
    jmsnas computes at full float32 precision here on any backend: this checks what is computed, not TF32."""
    params, state = supernet.init(jax.random.PRNGKey(1), space)
    model = TS.Supernet(space, exact_padding=True)
    TS.load_jax_params(model, space, params, state)
    model.eval()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, space.image_size, space.image_size, space.in_channels)).astype(np.float32)
    mask = jnp.asarray(space.mask())
    alpha = jnp.asarray(rng.standard_normal((space.num_layers, NUM_OPS)), jnp.float32)
    worst = 0.0
    for gates in (G.softmax_gates(alpha, mask), G.single_path_gates(jax.random.PRNGKey(2), alpha, mask)):
        with jax.default_matmul_precision("highest"):  # float32 on a GPU too (its default is TF32)
            ref, _ = supernet.apply(space, params, state, gates, jnp.asarray(x), train=False)
        paths = None if gates.paths is None else np.asarray(gates.paths).tolist()
        with torch.no_grad():
            got = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), TS._t(gates.weights), paths)
        err = float(np.max(np.abs(np.asarray(ref) - got.numpy())) / (np.max(np.abs(np.asarray(ref))) + 1e-30))
        if err > 1e-4:
            raise RuntimeError(f"torch reference differs from jmsnas by {err:.2e} (relative)")
        worst = max(worst, err)
    return worst


def bench_data(args, space) -> tuple:
    """One random batch: (x, y) for JAX, (x, y) for torch in its layout."""
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((args.batch, 32, 32, 3)).astype(np.float32)
    yn = rng.integers(0, space.num_classes, args.batch).astype(np.int32)
    xt = torch.from_numpy(xn.transpose(0, 3, 1, 2).copy()).to(args.torch_device, memory_format=args.fmt)
    return jnp.asarray(xn), jnp.asarray(yn), xt, torch.from_numpy(yn.astype(np.int64)).to(args.torch_device)


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_probe(args, space, data) -> None:
    """Child of ``--memory``: one side's steps of one mode alone in this process; prints a JSON line."""
    jrun, trun, _, steps, _ = build_mode(args.modes[0], args, space, data)
    run = {"jax": jrun, "torch": trun, "none": None}[args.memory_side]
    if run is not None:
        for r in range(-1, args.warmup + 2):
            run(r)
    print(json.dumps({"mode": args.modes[0], "side": args.memory_side, "peak_mb": _status_kb("VmHWM") / 1024}),
          flush=True)


def peak_memory_rows(args) -> list:
    """Markdown rows of peak host memory above a process that runs no step, JAX and PyTorch, one process each."""
    rows = ["| mode | JAX MB | PyTorch MB | JAX / PyTorch | no step: peak MB |", "|---|---:|---:|---:|---:|"]
    for mode in args.modes:
        got = {}
        for side in ("none", "jax", "torch"):
            cmd = [sys.executable, os.path.abspath(__file__), "--modes", mode, "--memory-side", side, "--no-check",
                   "--batch", str(args.batch), "--threads", str(args.threads), "--allocator", args.allocator,
                   "--steps-sampled", str(args.steps_sampled), "--steps-mixture", str(args.steps_mixture),
                   "--dw-impl", args.dw_impl, "--candidate-impl", args.candidate_impl,
                   "--layers-per-device", *map(str, args.layers_per_device)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rec = json.loads(out.strip().splitlines()[-1])
            got[side] = rec["peak_mb"]
        jax_mb, torch_mb = got["jax"] - got["none"], got["torch"] - got["none"]
        rows.append(f"| {mode} | {jax_mb:.0f} | {torch_mb:.0f} | {jax_mb / torch_mb:.2f}x | {got['none']:.0f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions after the first (compiling) step")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads (XLA:CPU uses every core)")
    p.add_argument("--steps-sampled", type=int, default=6, help="steps per repetition: sampled/derived modes")
    p.add_argument("--steps-mixture", type=int, default=2, help="steps per repetition: all-path modes")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--torch-layout", choices=("nchw", "channels_last"), default="channels_last")
    p.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                   help="where PyTorch runs (JAX runs on its default backend: JAX_PLATFORMS=cuda for the GPU)")
    p.add_argument("--json", default=None, help="also write the table's rows to this file")
    p.add_argument("--dw-impl", default="auto", choices=("auto", "native", "shifted", "xla"))
    p.add_argument("--candidate-impl", default="auto", choices=("auto", "own", "padded"),
                   help="how the supernet computes candidates (jmsnas.supernet.candidate_impl)")
    p.add_argument("--xla-vector-width", type=int, default=None, help="sets --xla_cpu_prefer_vector_width")
    p.add_argument("--no-check", action="store_true", help="skip the value check of the torch reference")
    p.add_argument("--allocator", choices=("default", "off", "keep"), default="default",
                   help="default: jmsnas as the command runs it (jmsnas.hostmem.apply); off: "
                        "JMSNAS_KEEP_FREED_MEMORY=0; keep: JMSNAS_KEEP_FREED_MEMORY=1 (one untrimmed heap)")
    p.add_argument("--layers-per-device", type=int, nargs=4, default=[2, 2, 2, 2],
                   help="searchable layers per device of the chain (5 5 5 5: experiments/configs/cifar_chain.py)")
    p.add_argument("--memory", action="store_true",
                   help="also measure each side's peak host memory per mode, each side alone in a fresh process")
    p.add_argument("--memory-side", choices=("jax", "torch", "none"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reps < 5:
        raise ValueError(f"--reps must be at least 5 (median of >= 5 repetitions), got {args.reps}")
    torch.set_num_threads(args.threads)
    args.fmt = torch.channels_last if args.torch_layout == "channels_last" else torch.contiguous_format
    if args.torch_device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--torch-device cuda: this torch build sees no CUDA device")
    if args.memory and args.torch_device != "cpu":
        raise SystemExit("--memory measures host memory: it needs --torch-device cpu")
    space = bench_space(args.layers_per_device)
    if args.memory_side is not None:  # a child of --memory
        memory_probe(args, space, bench_data(args, space))
        return
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.threads} threads, "
          f"{args.torch_layout}), {os.cpu_count()} cpus, {platform.processor() or platform.machine()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, dw_impl={args.dw_impl}, "
          f"candidate_impl={args.candidate_impl}, layers per device {args.layers_per_device}, "
          f"allocator={args.allocator} (one untrimmed heap: {hostmem.applied()}, steps on the calling thread's "
          f"kept heap: {hostmem.keep_step_memory()})")
    print(f"load average at start: {os.getloadavg()}")
    if not args.no_check:
        print(f"torch reference vs jmsnas logits (exact padding): max relative difference "
              f"{check_reference(space):.1e}")
    peak_j, peak_t = matmul_peak(args.reps, device=args.torch_device)
    print(f"fp32 2048x2048 matmul: JAX {peak_j:.1f} GFLOP/s, torch {peak_t:.1f} GFLOP/s")

    data = bench_data(args, space)
    records = []
    rows = ["| mode | step | GFLOP/step | JAX img/s | PyTorch img/s | JAX / PyTorch | JAX GFLOP/s | % of peak |",
            "|---|---|---|---|---|---|---|---|"]
    for mode in args.modes:
        jrun, trun, fl, steps, desc = build_mode(mode, args, space, data)
        t0 = time.perf_counter()
        jrun(-1)  # compiles
        compile_s = time.perf_counter() - t0
        trun(-1)
        torch_sync(args.torch_device)
        jt, tt, gf, jf, tf = [], [], [], [], []
        for r in range(args.warmup + args.reps):
            f0, t0 = minor_faults(), time.perf_counter()
            jrun(r)
            f1, t1 = minor_faults(), time.perf_counter()
            trun(r)
            torch_sync(args.torch_device)
            f2, t2 = minor_faults(), time.perf_counter()
            if r >= args.warmup:
                jt.append(t1 - t0)
                tt.append(t2 - t1)
                jf.append((f1 - f0) / steps)
                tf.append((f2 - f1) / steps)
                gf.append(fl(r) * args.batch * steps / 1e9)
        j_ips = args.batch * steps / statistics.median(jt)
        t_ips = args.batch * steps / statistics.median(tt)
        gflop_step = float(np.mean(gf)) / steps
        j_gflops = gflop_step * j_ips / args.batch
        row = (f"| {mode} | {desc} | {gflop_step:.2f} | {j_ips:.0f} | {t_ips:.0f} | {j_ips / t_ips:.2f}x | "
               f"{j_gflops:.1f} | {100 * j_gflops / peak_j:.0f}% |")
        rows.append(row)
        records.append({"mode": mode, "jax_img_s": j_ips, "torch_img_s": t_ips, "jax_over_torch": j_ips / t_ips,
                        "jax_gflops": j_gflops, "gflop_per_step": gflop_step, "jax_first_call_s": compile_s})
        print(row + f"  (first call {compile_s:.1f} s; load {os.getloadavg()[0]:.1f}; "
              f"JAX reps {[round(t, 3) for t in jt]}, torch reps {[round(t, 3) for t in tt]}; "
              f"page faults/step JAX {statistics.median(jf):.0f}, torch {statistics.median(tf):.0f})", flush=True)
    print("\n" + "\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax_backend": jax.default_backend(), "jax_devices": [d.device_kind for d in jax.devices()],
                       "torch_device": args.torch_device, "torch": torch.__version__, "batch": args.batch,
                       "reps": args.reps, "matmul_gflops": {"jax": peak_j, "torch": peak_t}, "rows": records}, f,
                      indent=2)
    if args.memory:
        print("\npeak host memory above a process that runs no step, each side alone in a fresh process:")
        print("\n".join(peak_memory_rows(args)))
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
