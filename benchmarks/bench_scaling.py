"""Compile time and step time of the search's steps as the space grows: layers, devices, image size, split.

Usage:
  python benchmarks/bench_scaling.py [--sweeps layers devices image split] [--steps weight arch gumbel_arch eval64]
                                     [--reps 3] [--batch 64] [--out benchmarks/results/scaling]

Sweeps (every other setting as the main job: widths 24/32/48/64 repeated per device, strides 1/2/1/2 on the
first four devices and 1 after, digits-sized 8x8x1 input, 10 classes, batch 64):
  layers   the four-device chain with 2, 4, 8 searchable layers per device (8, 16, 32 layers)
  devices  a chain of 2, 4, 8 devices and a mesh of 4, 6, 8 devices (UE -> root -> D-3 parallel branches ->
           aggregator), 2 layers per device
  image    the 8-layer chain at 8x8, 32x32, 64x64 (3 channels for 32 and 64)
  split    the 8/16/32-layer chain with the searched split (``split="searched"``: the O(M N^2) split DP inside
           every architecture step; only the steps that compute a latency change)
Steps: ``weight`` (two-path weight step), ``arch`` (two-path architecture step), ``gumbel_arch`` (Gumbel-softmax
architecture step, every path computed), ``eval64`` (``evaluate_population`` of 64 random sub-networks on one
batch). Compile time: ``jit(...).lower(...).compile()`` wall and CPU seconds with the persistent compilation
cache off (a fresh compile); step time: the median of ``--reps`` calls after one warm-up call. Writes
``<out>.json``, ``<out>.md`` (a markdown table) and ``<out>.png`` (compile and step time against each sweep's
variable), and prints the table with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JMSNAS_COMPILE_CACHE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jmsnas import evaluate as E  # noqa: E402
from jmsnas import train  # noqa: E402
from jmsnas.topology import presets
from jmsnas.cost.tables import analytic_table  # noqa: E402
from jmsnas.space import OPS, build_space, op_flops  # noqa: E402
from jmsnas.topology import LinkProfile, make_topology  # noqa: E402

STEPS = ("weight", "arch", "gumbel_arch", "eval64")
SWEEPS = ("layers", "devices", "image", "split")
WIDTHS = (24, 32, 48, 64)
STRIDES = (1, 2, 1, 2)


def chain(num_devices: int, layers_per_device: int):
    """UE -> SBS -> MBS ... -> cloud: the paper's device classes, Table I-like links (25/50/200 Mbit/s)."""
    roles = ["ue"] + ["sbs", "mbs"] * num_devices
    roles = roles[:num_devices - 1] + ["cloud"] if num_devices > 1 else ["ue"]
    names = [f"{r}{i}" for i, r in enumerate(roles)]
    devs = [presets.device(presets.ROLES[r], n) for r, n in zip(roles, names)]
    bw = (25.0, 50.0) + (200.0,) * num_devices
    links = [LinkProfile(a, b, bw[i], 0.0, i < 2) for i, (a, b) in enumerate(zip(names, names[1:]))]
    return make_topology("chain", devs, links, (layers_per_device,) * num_devices)


def mesh(num_devices: int, layers_per_device: int = 2):
    """UE -> SBS (root) -> num_devices - 3 parallel MBS -> cloud (aggregator), as presets.mesh_preset."""
    mbs = [f"mbs{i}" for i in range(1, num_devices - 2)]
    devs = [presets.device(presets.ROLES["ue"], "ue"), presets.device(presets.ROLES["sbs"], "sbs")]
    devs += [presets.device(presets.ROLES["mbs"], n) for n in mbs] + [presets.device(presets.ROLES["cloud"], "cloud")]
    links = [LinkProfile("ue", "sbs", 25.0, 0.0, True)]
    links += [LinkProfile("sbs", n, 50.0, 0.0, True) for n in mbs] + [LinkProfile(n, "cloud", 200.0, 0.0, False)
                                                                       for n in mbs]
    return make_topology("mesh", devs, links, (layers_per_device,) * num_devices)


def space_of(topo, image: int = 8):
    m = topo.num_devices
    widths = [WIDTHS[min(i, 3)] for i in range(m)]
    strides = [STRIDES[i] if i < 4 else 1 for i in range(m)]
    if topo.kind == "mesh":  # branches keep the root's shape, as in configs.mesh_config
        widths = [24, 32] + [48] * (m - 3) + [64]
        strides = [1, 2] + [1] * (m - 3) + [2]
    return build_space(topo, image_size=image, in_channels=1 if image == 8 else 3, num_classes=10,
                       device_channels=tuple(widths), device_strides=tuple(strides))


def cases(sweeps):
    """(sweep, x value, label, space, split)."""
    out = []
    if "layers" in sweeps:
        out += [("layers", 4 * k, f"chain 4 dev, {4 * k} layers", space_of(chain(4, k)), "fixed") for k in (2, 4, 8)]
    if "devices" in sweeps:
        out += [("devices", d, f"chain {d} dev", space_of(chain(d, 2)), "fixed") for d in (2, 4, 8)]
        out += [("devices", d, f"mesh {d} dev", space_of(mesh(d)), "fixed") for d in (4, 6, 8)]
    if "image" in sweeps:
        out += [("image", s, f"chain 8 layers, {s}x{s}", space_of(chain(4, 2), s), "fixed") for s in (8, 32, 64)]
    if "split" in sweeps:
        out += [("split", 4 * k, f"chain 4 dev, {4 * k} layers, searched split", space_of(chain(4, k)), "searched")
                for k in (2, 4, 8)]
    return out


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def measure(space, split: str, step: str, batch: int, reps: int) -> dict:
    """Compile wall/CPU seconds and median step seconds of one step on one space."""
    table = analytic_table(space)
    gate = "gumbel_soft" if step == "gumbel_arch" else "two_path"
    hp = train.SearchHParams(gate_mode=gate, split=split)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, space.image_size, space.image_size, space.in_channels)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
    st = train.init_search_state(jax.random.PRNGKey(0), space, hp)
    if step == "eval64":
        ops = jnp.asarray(random_population(space, 64))
        fn = jax.jit(lambda p, s, o, xx, yy: E._evaluate_population(space, table, p, s, o, xx, yy, None,
                                                                      chunk=E.default_chunk()))
        args = (st.params, st.bn, ops, x, y)
        compiled, cw, cc = _timed(lambda: fn.lower(*args).compile())
        call = lambda: jax.block_until_ready(compiled(*args))
    else:
        weight_step, arch_step, _ = train.make_search_steps(space, table, hp)
        f = weight_step if step == "weight" else arch_step
        compiled, cw, cc = _timed(lambda: f.lower(st, x, y).compile())
        state = [st]

        def call():
            state[0], m = compiled(state[0], x, y)
            jax.block_until_ready(m)
    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return {"compile_wall_s": cw, "compile_cpu_s": cc, "step_s": statistics.median(times)}


def work(space) -> dict:
    """What a step has to compute, from the space alone: the valid candidates over all layers, and the forward
    MFLOP per image of every valid candidate (what the Gumbel-softmax step runs) and of the mean sampled path (one
    uniformly drawn candidate per layer; the two-path steps run two). ``jmsnas.space.op_flops``, 2 per
    multiply-add, convolutions only."""
    mask = space.mask()
    per_layer = [[op_flops(OPS[i], s) for i in np.flatnonzero(mask[n])] for n, s in enumerate(space.layers)]
    return {"valid_candidates": int(mask.sum()), "all_candidates_mflop": sum(map(sum, per_layer)) / 1e6,
            "mean_path_mflop": sum(float(np.mean(f)) for f in per_layer) / 1e6}


def random_population(space, size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mask = space.mask()
    return np.array([[rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)] for _ in range(size)],
                    np.int32)


def growth(rows, sweep, step, kind="compile_cpu_s"):
    """Ratio of the largest to the smallest x's value and the ratio of the x's (linear growth: equal)."""
    pts = sorted((r["x"], r[kind]) for r in rows if r["sweep"] == sweep and r["step"] == step
                 and r["label"].startswith("chain"))
    if len(pts) < 2:
        return None
    return pts[-1][1] / pts[0][1], pts[-1][0] / pts[0][0]


def plot(rows, path):
    from matplotlib.figure import Figure
    sweeps = [s for s in SWEEPS if any(r["sweep"] == s for r in rows)]
    fig = Figure(figsize=(4 * len(sweeps), 7), layout="constrained")
    axes = fig.subplots(2, len(sweeps), squeeze=False)
    for j, sweep in enumerate(sweeps):
        for kind, ax in (("compile_cpu_s", axes[0][j]), ("step_s", axes[1][j])):
            for step in STEPS:
                for fam in ("chain", "mesh"):
                    pts = sorted((r["x"], r[kind]) for r in rows if r["sweep"] == sweep and r["step"] == step
                                 and r["label"].startswith(fam))
                    if pts:
                        ax.plot(*zip(*pts), "o-" if fam == "chain" else "s--", label=f"{step} ({fam})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel({"layers": "searchable layers", "devices": "devices", "image": "image side (px)",
                           "split": "layers (searched split)"}[sweep])
            ax.set_ylabel("compile CPU s" if kind == "compile_cpu_s" else "step s (median)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][j].legend(fontsize=7)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", nargs="+", default=list(SWEEPS), choices=SWEEPS)
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scaling"))
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    print(f"jax {jax.__version__} ({jax.default_backend()}), {os.cpu_count()} cpus, load average at start "
          f"{os.getloadavg()}", flush=True)
    rows = []
    for sweep, x, label, space, split in cases(args.sweeps):
        for step in args.steps:
            if sweep == "split" and step in ("weight", "eval64"):
                continue  # no latency in these steps: the split does not change them
            r = {**measure(space, split, step, args.batch, args.reps), **work(space)}
            rows.append({"sweep": sweep, "x": x, "label": label, "step": step, "layers": space.num_layers, **r})
            print(f"| {sweep} | {label} | {step} | {r['compile_wall_s']:.1f} | {r['compile_cpu_s']:.1f} | "
                  f"{1e3 * r['step_s']:.1f} |  (load {os.getloadavg()[0]:.1f})", flush=True)
    table = ["| sweep | case | step | compile wall s | compile CPU s | step ms (median) | valid candidates | "
             "forward MFLOP/image: all candidates / mean path |", "|---|---|---|---:|---:|---:|---:|---:|"]
    table += [f"| {r['sweep']} | {r['label']} | {r['step']} | {r['compile_wall_s']:.1f} | {r['compile_cpu_s']:.1f} | "
              f"{1e3 * r['step_s']:.1f} | {r['valid_candidates']} | {r['all_candidates_mflop']:.1f} / "
              f"{r['mean_path_mflop']:.2f} |" for r in rows]
    notes = []
    for sweep in ("layers", "split"):
        for step in args.steps:
            g = growth(rows, sweep, step)
            if g:
                t = growth(rows, sweep, step, "step_s")
                w = growth(rows, sweep, step, "all_candidates_mflop" if step == "gumbel_arch" else "mean_path_mflop")
                notes.append(f"{sweep} {step}: compile CPU x{g[0]:.2f}, step x{t[0]:.2f}, forward FLOPs "
                             f"({'all candidates' if step == 'gumbel_arch' else 'mean path'}) x{w[0]:.2f} "
                             f"for x{g[1]:.0f} layers")
    text = "\n".join(table) + "\n\n" + "\n".join(f"- {n}" for n in notes) + \
        f"\n\nload average at end: {os.getloadavg()}\n"
    print("\n" + text)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": rows, "argv": sys.argv[1:], "jax": jax.__version__}, f, indent=1)
    plot(rows, args.out + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
