"""Benchmark: batched population evaluation (``jmsnas.evaluate.evaluate_population``) against the loop.

P sub-networks of the default space (``presets.chain_preset()``, 8 layers, 8x8x1 inputs, device channels
24/32/48/64, strides 1/2/1/2; ``--layers-per-device`` sets the layers on each device) sampled uniformly from the
valid candidates, evaluated on one batch of B digits-sized inputs. Rows:

* ``loop``: ``evaluate_loop``, a Python loop of one jitted single-architecture evaluation (``supernet.apply``
  with one-hot gates): the peer;
* ``vmap(single)`` (with ``--vmap``): ``jax.vmap`` of that same single-architecture evaluation, jitted (plain
  vmap; vmapping its per-layer ``lax.switch`` turns it into a select that runs every candidate);
* ``batched chunk=c``: ``evaluate_population`` with chunks of c architectures (and ``no prefix sharing``: with
  ``share_prefixes=False``, every architecture computed in full after the shared stem and layer 0);
* with ``--bn-batches K > 0`` the loop and the batched evaluator (first chunk size listed) also run with BN
  recalibration on K batches;
* ``PyTorch loop`` (unless ``--no-torch``): what a user would otherwise write (OFA's way): the same population, one
  sub-network at a time, through the PyTorch reference of the same supernet (``benchmarks/torch_supernet.py``,
  its weights copied from jmsnas's), eager, ``channels_last``, ``--threads`` threads, the same batch, only each
  layer's chosen candidate computed, under ``torch.inference_mode``; loss and accuracy per sub-network. With BN
  recalibration (``PyTorch loop, BN recal K``) each sub-network's batch norms (stem, chosen candidates, head) are
  reset and re-estimated in train mode over the K batches as a cumulative average (``momentum=None``: PyTorch's
  own exact average, of unbiased variances where jmsnas averages biased ones: the same work), then the batch is
  evaluated in eval mode. Its loss and accuracy without recalibration are checked against the JAX loop (with the
  reference's XLA-exact padding; the timed model pads the natural way, the same work).

Each row is the median of ``--reps`` timed repetitions after one warm-up call (which compiles); the rows are
timed interleaved (one repetition of every row, then the next) so that load from other processes spreads over
all of them. Results are checked equal to the loop before timing. Prints a markdown table with the speed-up.

It also prints what bounds the speed-up: the useful FLOPs of the population (``jmsnas.space.op_flops`` of every
architecture's candidates + stem + head, 2 per multiply-add, forward only), the loop's rate in GFLOP/s against
this machine's fp32 2048x2048 matmul rate (JAX, same run), and the fraction of that work prefix sharing removes.
A batched evaluator that ran every convolution at the matmul rate could be at most
``matmul rate / loop rate / (1 - shared fraction)`` times faster than the loop.

The table's last column is each JAX row's speed-up over the PyTorch loop (the recalibrating rows over the
recalibrating PyTorch loop), and a closing line gives JAX batched (first chunk size) / PyTorch loop with and without
BN recalibration; ``--json FILE`` also writes the medians and ratios.

Run: python benchmarks/bench_batched_eval.py [--population 64] [--batch 256] [--reps 5]
     [--chunks 1,2,4,8] [--bn-batches 2] [--layers-per-device 2 2 2 2] [--vmap] [--threads 2] [--no-torch]
     [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import evaluate as E
from jmsnas import supernet
from jmsnas.topology import presets
from jmsnas.cost.tables import analytic_table, head_flops, stem_flops
from jmsnas.space import OPS, build_space, op_flops


def default_space(layers_per_device=(2, 2, 2, 2)):
    return build_space(presets.chain_preset(tuple(layers_per_device)), image_size=8, in_channels=1, num_classes=10,
                       device_channels=(24, 32, 48, 64), device_strides=(1, 2, 1, 2))


def random_population(space, size: int, seed: int = 0) -> np.ndarray:
    """int32[size, N]: every layer's candidate drawn uniformly from its valid ones."""
    rng = np.random.default_rng(seed)
    mask = space.mask()
    return np.array([[rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)]
                     for _ in range(size)], np.int32)


def population_flops(space, ops) -> tuple:
    """(FLOPs per image summed over the architectures, the same with each distinct prefix counted once)."""
    every = shared = 0.0
    seen = set()
    for arch in np.asarray(ops):
        every += stem_flops(space) + head_flops(space)
        for n, i in enumerate(arch):
            f = op_flops(OPS[int(i)], space.layers[n])
            every += f
            if tuple(arch[:n + 1]) not in seen:
                seen.add(tuple(arch[:n + 1]))
                shared += f
        shared += head_flops(space)
    return every, shared + stem_flops(space)


def matmul_gflops(reps: int = 5, n: int = 2048) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda v: v @ v)
    block(f(a))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        block(f(a))
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def block(tree):
    return jax.block_until_ready(tree)


class TorchLoop:
    """The population one sub-network at a time in PyTorch (module docstring): ``__call__(recal)`` returns
    {"loss", "accuracy"} as float64 arrays [P]."""

    def __init__(self, space, params, state, ops, x, y, bn_batches, threads: int, exact_padding: bool = False,
                 device: str = "cpu"):
        import torch

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import torch_supernet as TS

        self.torch, self.F = torch, torch.nn.functional
        torch.set_num_threads(threads)
        fmt = torch.channels_last
        to_nchw = lambda a: torch.from_numpy(np.asarray(a).transpose(0, 3, 1, 2).copy()).to(device,
                                                                                             memory_format=fmt)
        self.x, self.y = to_nchw(x), torch.from_numpy(np.asarray(y).astype(np.int64)).to(device)
        self.bn_batches = [to_nchw(b) for b in np.asarray(bn_batches)] if bn_batches is not None else []
        self.models = {}
        for recal in (False, True):  # one model each: recalibration rewrites running statistics
            model = TS.Supernet(space, exact_padding=exact_padding)
            TS.load_jax_params(model, space, params, state)
            self.models[recal] = model.to(device, memory_format=fmt).eval()
        self.archs = [[int(i) for i in arch] for arch in np.asarray(ops)]
        self.gates = [torch.nn.functional.one_hot(torch.as_tensor(a), space.mask().shape[1]).float().to(device)
                      for a in self.archs]

    def _norms(self, model, arch):
        out = [model.stem_bn, model.head_bn]
        for layer, i in zip(model.layers, arch):
            cand = layer.candidates[str(i)]
            out += [m for m in (getattr(cand, "bn1", None), getattr(cand, "bn2", None), getattr(cand, "bn3", None))
                    if m is not None]
        return out

    def __call__(self, recal: bool = False) -> dict:
        torch, model = self.torch, self.models[recal]
        losses, accs = [], []
        for arch, gates in zip(self.archs, self.gates):
            paths = [[i] for i in arch]
            if recal:
                norms = self._norms(model, arch)
                for bn in norms:
                    bn.reset_running_stats()
                    bn.momentum = None  # cumulative average over the K batches
                    bn.train()
                with torch.no_grad():
                    for xb in self.bn_batches:
                        model(xb, gates, paths)
                for bn in norms:
                    bn.eval()
            with torch.inference_mode():
                logits = model(self.x, gates, paths)
                losses.append(float(self.F.cross_entropy(logits, self.y)))
                accs.append(float((logits.argmax(-1) == self.y).float().mean()))
        return {"loss": np.asarray(losses), "accuracy": np.asarray(accs)}


def agreement(backend: str, batch: int) -> dict:
    """How closely two evaluations of one network must agree, per output. On the CPU: float32 round-off. On a GPU,
    JAX's and cuDNN's default precision runs float32 convolutions and matrix products in TF32 (10 mantissa bits),
    and a batched program sums in another order than the loop's: the loss may move by 2e-3 and, on a near tie of
    two logits, an image's prediction may flip, so the accuracy may differ by two images of the batch. A wrong
    network differs by far more (its accuracy is another network's)."""
    if backend == "cpu":
        return {k: dict(rtol=2e-4, atol=2e-4) for k in ("loss", "accuracy", "latency_ms")}
    return {"loss": dict(rtol=2e-3, atol=2e-3), "accuracy": dict(rtol=0.0, atol=2.0 / batch + 1e-7),
            "latency_ms": dict(rtol=2e-4, atol=2e-4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--population", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--bn-batches", type=int, default=2, help="K recalibration batches (0: skip those rows)")
    ap.add_argument("--layers-per-device", type=int, nargs=4, default=[2, 2, 2, 2],
                    help="searchable layers on each of the four devices (1 1 1 1: the CPU side of gpu_check.sh)")
    ap.add_argument("--vmap", action="store_true",
                    help="add the plain vmap row (vmapping lax.switch computes every candidate: memory heavy)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch loop (needs torch: the bench extra)")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads (XLA:CPU uses every core)")
    ap.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                    help="where PyTorch runs (JAX runs on its default backend: JAX_PLATFORMS=cuda for the GPU)")
    ap.add_argument("--json", default=None, help="also write the medians and ratios to this file")
    args = ap.parse_args(argv)
    for name in ("population", "batch", "reps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")

    space = default_space(args.layers_per_device)
    table = analytic_table(space)
    params, state = supernet.init(jax.random.PRNGKey(0), space)
    kx, ky, kb = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.uniform(kx, (args.batch, 8, 8, 1), jnp.float32, 0.0, 16.0)
    y = jax.random.randint(ky, (args.batch,), 0, 10)
    bn = jax.random.uniform(kb, (args.bn_batches, args.batch, 8, 8, 1), jnp.float32, 0.0, 16.0)
    ops = random_population(space, args.population)
    common = (space, table, params, state)

    rows = {"loop": lambda: E.evaluate_loop(*common, ops, x, y)}
    if args.vmap:
        single = jax.jit(jax.vmap(lambda o: E._evaluate_one(space, table, params, state, o, x, y, None)))
        rows["vmap(single)"] = lambda: single(jnp.asarray(ops))
    chunks = [int(v) for v in args.chunks.split(",")]
    rows[f"batched chunk={chunks[0]}, no prefix sharing"] = lambda: E.evaluate_population(
        *common, ops, x, y, chunk=chunks[0], share_prefixes=False)
    for c in chunks:
        rows[f"batched chunk={c}"] = lambda c=c: E.evaluate_population(*common, ops, x, y, chunk=c)
    if args.bn_batches:
        rows[f"loop, BN recal K={args.bn_batches}"] = lambda: E.evaluate_loop(*common, ops, x, y, bn_batches=bn)
        c = chunks[0]
        rows[f"batched chunk={c}, BN recal K={args.bn_batches}"] = lambda: E.evaluate_population(
            *common, ops, x, y, bn_batches=bn, chunk=c)

    tol = agreement(jax.default_backend(), args.batch)
    reference = {}
    for name, fn in rows.items():  # warm-up (compiles) and equality check against the matching loop
        out = block(fn())
        key = "recal" if "BN recal" in name else "plain"
        if key not in reference:
            reference[key] = out
        for k in ("loss", "accuracy", "latency_ms"):
            np.testing.assert_allclose(np.asarray(out[k]), np.asarray(reference[key][k]), **tol[k],
                                       err_msg=f"{name}: {k} differs from the loop")
    torch_rows = {}
    if not args.no_torch:
        exact = TorchLoop(space, params, state, ops[:8], x, y, None, args.threads, exact_padding=True,
                          device=args.torch_device)()
        for k in ("loss", "accuracy"):  # the reference computes what jmsnas computes
            np.testing.assert_allclose(exact[k], np.asarray(reference["plain"][k])[:8], **tol[k],
                                       err_msg=f"PyTorch loop: {k} differs from the JAX loop")
        peer = TorchLoop(space, params, state, ops, x, y, bn if args.bn_batches else None, args.threads,
                         device=args.torch_device)
        torch_rows["PyTorch loop"] = lambda: peer(False)
        if args.bn_batches:
            torch_rows[f"PyTorch loop, BN recal K={args.bn_batches}"] = lambda: peer(True)
        for fn in torch_rows.values():
            fn()  # warm-up
        rows.update(torch_rows)
    times = {name: [] for name in rows}
    for _ in range(args.reps):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(t) for name, t in times.items()}
    every, shared = population_flops(space, ops)
    peak = matmul_gflops()
    loop_rate = every * args.batch / med["loop"] / 1e9
    saved = 1.0 - shared / every
    print(f"work: {every * args.batch / 1e9:.1f} GFLOP forward for the population ({saved:.1%} of it in shared "
          f"prefixes); loop {loop_rate:.1f} GFLOP/s, fp32 matmul {peak:.1f} GFLOP/s here: a batched evaluator at "
          f"the matmul rate would be at most {peak / loop_rate / (1.0 - saved):.2f}x the loop\n")
    print(f"P = {args.population} architectures, batch {args.batch} x 8x8x1, median of {args.reps} reps "
          f"(interleaved), {jax.devices()[0].platform}\n")
    recal = f"BN recal K={args.bn_batches}"
    vs_torch = bool(torch_rows)
    print("| method | median s | per architecture ms | speed-up vs its loop |"
          + (" speed-up vs the PyTorch loop |" if vs_torch else ""))
    print("|---|---:|---:|---:|" + ("---:|" if vs_torch else ""))
    for name, t in med.items():
        peer = med[f"loop, {recal}"] if "BN recal" in name else med["loop"]
        line = f"| {name} | {t:.3f} | {1e3 * t / args.population:.1f} | {peer / t:.2f}x |"
        if vs_torch:
            tpeer = med[f"PyTorch loop, {recal}"] if "BN recal" in name else med["PyTorch loop"]
            line += f" {tpeer / t:.2f}x |"
        print(line)
    summary = {"population": args.population, "batch": args.batch, "reps": args.reps, "bn_batches": args.bn_batches,
               "median_s": med, "loop_gflops": loop_rate, "matmul_gflops": peak, "platform": jax.devices()[0].platform,
               "torch_device": None if args.no_torch else args.torch_device}
    if vs_torch:
        c = chunks[0]
        summary["jax_batched_over_torch_loop"] = {"plain": med["PyTorch loop"] / med[f"batched chunk={c}"]}
        line = (f"\nJAX batched (chunk={c}) / PyTorch loop: {summary['jax_batched_over_torch_loop']['plain']:.2f}x "
                f"without BN recalibration")
        if args.bn_batches:
            summary["jax_batched_over_torch_loop"]["bn_recal"] = (med[f"PyTorch loop, {recal}"]
                                                                  / med[f"batched chunk={c}, {recal}"])
            line += f", {summary['jax_batched_over_torch_loop']['bn_recal']:.2f}x with ({recal})"
        print(line + f"; PyTorch on {args.torch_device} ({args.threads} threads), channels_last; load average "
                     f"{os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
