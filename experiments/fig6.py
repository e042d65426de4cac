"""Fig. 6 of the JMSNAS paper at our scale: searched networks against cloud computing and split MobileNets.

On the chain preset (UE -> SBS -> MBS -> cloud, Table I links, analytic roofline cost table) and the embedded
digits data, this compares:

* **JMSNAS**: the default chain search at the three Fig. 5 budgets (reused from ``runs/fig5/chain_<level>`` when
  finished there, else run into ``<out>/chain_<level>``), deployed with the fixed split D^m (2 layers per device,
  stem on the UE, classifier head on the cloud);
* **JMSNAS, fixed vs searched split** at the middle budget: two fresh runs with the current code that differ only
  in ``split`` (``<out>/mid_fixed``, ``<out>/mid_searched``), and a third searched-split run whose T_const is the
  middle of the latency range reachable with a searched split (``searched_split_range``; the Fig. 5 budgets are
  placed in the fixed split's range, which a searched split undercuts entirely) in ``<out>/mid_searched_rebudget``;
* **cloud computing**: the same JMSNAS networks with the raw 8-bit image uploaded through every link and the stem,
  all layers and the head on the cloud (``jmsnas.split.solvers.cloud_only`` on the whole network);
* **MobileNetV2 / V3-Large at our scale**: fixed architectures of the default space (``mobilenet_ops``), trained
  from scratch with the retrain budget of the JMSNAS runs and split by the exact chain DP with JMSNAS's
  conventions (stem on the UE, head on the cloud: ``cost.latency.best_chain_assignment``) and without them
  (``solvers.chain_dp`` over stem + layers + head, where every device may take any contiguous range);
* **reference at the paper's input size**: the zoo's MobileNetV1/V2/V3-Large at 224x224x3 on the same chain,
  split by the same solvers (latency only; accuracies are the published ImageNet figures, not measured here).

Usage:
  python experiments/fig6.py [--out runs/fig6] [--fig5 runs/fig5] [--results experiments/results] [--quick]

Writes ``<out>/fig6_data.json`` (every row with its latency breakdown and accuracies), ``<out>/fig6_tables.md``
(the two tables) and ``<results>/fig6.png`` (test accuracy against latency, log scale). The discussion in
``experiments/results/fig6.md`` is written from those.

``--quick`` shortens every training (1 warm-up + 2 search epochs, 2 retrain epochs) and writes to
``runs/fig6_quick`` (results there too). Finished runs are skipped, so the command can be started again.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIG5_CONFIG = os.path.join(HERE, "configs", "fig5.py")
LEVELS = ("tight", "mid", "loose")
WALL_FILE = "fig6_wall.json"

# (kernel, expansion ratio) of every inverted-residual block, in order.
# MobileNetV2: Sandler et al. 2018, Table 2 (t = 1 for the first bottleneck, 6 for the other 16; all 3x3).
MOBILENET_V2_BLOCKS = ((3, 1.0),) + ((3, 6.0),) * 16
# MobileNetV3-Large: Howard et al. 2019, Table 1 (expansion = exp size / input channels).
MOBILENET_V3_LARGE_BLOCKS = ((3, 1.0), (3, 4.0), (3, 3.0), (5, 3.0), (5, 3.0), (5, 3.0), (3, 6.0), (3, 2.5),
                             (3, 2.3), (3, 2.3), (3, 6.0), (3, 6.0), (5, 6.0), (5, 6.0), (5, 6.0))
BASELINES = {"mobilenet_v2": MOBILENET_V2_BLOCKS, "mobilenet_v3_large": MOBILENET_V3_LARGE_BLOCKS}
SHORT = {"mobilenet_v2": "V2", "mobilenet_v3_large": "V3-L"}
# Published ImageNet top-1 (%) of the zoo networks at 224x224 (the papers above; V1: Howard et al. 2017, Table 8).
PUBLISHED_TOP1 = {"mobilenet_v1": 70.6, "mobilenet_v2": 72.0, "mobilenet_v3_large": 75.2}


# ----------------------------------------------------------------------------------------------- architectures

def _nearest(value: float, choices) -> int:
    """The choice closest to ``value`` (the smaller one on a tie)."""
    return min(choices, key=lambda c: (abs(c - value), c))


def mobilenet_ops(space, blocks) -> tuple:
    """A MobileNet's blocks mapped onto the slots of ``space``: int op index per slot.

    Slot n of N takes the block at the same relative depth, ``round(n * (B - 1) / (N - 1))`` of B blocks; its
    kernel becomes the nearest of the space's kernels (3/5/7) and its expansion the nearest of 3/6; the shortcut
    is used wherever the slot keeps its shape (stride 1, same channels), as in the inverted residual block.
    Channels and strides are the space's (per device), not the MobileNet's; there is no SE and no h-swish.
    """
    from jmsnas.space import OPS, op_index
    blocks = tuple(blocks)
    if not blocks or any(len(b) != 2 or b[0] <= 0 or b[1] <= 0 for b in blocks):
        raise ValueError(f"blocks must be a non-empty sequence of (kernel > 0, expansion > 0), got {blocks!r}")
    n = space.num_layers
    kernels = sorted({o.kernel for o in OPS if not o.is_identity})
    expands = sorted({o.expand for o in OPS if not o.is_identity})
    ops = []
    for s in space.layers:
        b = blocks[round(s.index * (len(blocks) - 1) / (n - 1))] if n > 1 else blocks[0]
        name = f"mbconv_k{_nearest(b[0], kernels)}_e{_nearest(b[1], expands)}" + ("_res" if s.keeps_shape else "")
        ops.append(op_index(name))
    space.validate_arch(ops)
    return tuple(ops)


# ----------------------------------------------------------------------------------------------- latencies

def whole_network_costs(space, table, ops):
    """The whole network (stem, the N layers of ``ops``, head) as arrays for ``jmsnas.split.solvers``.

    Returns (compute_ms float[N+2, M], out_bytes float[N+2], input_bytes): row 0 is the stem, rows 1..N the
    layers, row N+1 the head (its output, the logits at the table's activation width, never needs to move).
    Devices are indexed as in ``space.topology.devices``; bytes per image.
    """
    ops = np.asarray(ops)
    space.validate_arch(ops)
    c = np.asarray(table.compute_ms, np.float64)[:, np.arange(space.num_layers), ops].T  # [N, M]
    compute = np.concatenate([np.asarray(table.stem_ms, np.float64)[None], c,
                              np.asarray(table.head_ms, np.float64)[None]])
    per_value = float(table.stem_bytes) / (space.stem_out_hw ** 2 * space.stem_channels)  # bytes per activation
    out = np.concatenate([[float(table.stem_bytes)], np.asarray(table.out_bytes, np.float64),
                          [space.num_classes * per_value]])
    return compute, out, float(table.input_bytes)


def _from_split_result(r) -> dict:
    return {"total": float(r.total_ms), "per_device": dict(r.per_device_ms), "per_link": dict(r.per_link_ms)}


def cloud_computing(space, table, ops) -> dict:
    """Latency breakdown (ms) of uploading the raw image through every link and running everything on the cloud."""
    from jmsnas.split import solvers
    return _from_split_result(solvers.cloud_only(*whole_network_costs(space, table, ops), space.topology))


def free_split(space, table, ops) -> tuple:
    """(breakdown, assignment int[N+2] over stem/layers/head) of the exact chain DP over the whole network."""
    from jmsnas.split import solvers
    r = solvers.chain_dp(*whole_network_costs(space, table, ops), space.topology)
    return _from_split_result(r), np.asarray(r.assignment)


def jmsnas_split(space, table, ops, assignment=None) -> dict:
    """Eq. (1) breakdown with the stem on the UE and the head on the cloud; ``assignment`` None = D^m."""
    from jmsnas.cost.latency import arch_latency, breakdown_dict
    return breakdown_dict(space, arch_latency(space, table, np.asarray(ops), assignment))


def best_jmsnas_split(space, table, ops) -> tuple:
    """(breakdown, assignment int[N]) of the exact chain DP with the stem on the UE and the head on the cloud."""
    import jax
    from jmsnas.cost.latency import best_chain_assignment
    from jmsnas.space import NUM_OPS
    a = np.asarray(best_chain_assignment(space, table, jax.nn.one_hot(np.asarray(ops), NUM_OPS)))
    return jmsnas_split(space, table, ops, a), a


def split_text(space, assignment, whole: bool = False) -> str:
    """'ue: L0-L6 | cloud: L7' (with ``whole``, the assignment covers stem, layers, head)."""
    names = space.topology.device_names
    labels = (["stem"] + [f"L{i}" for i in range(space.num_layers)] + ["head"]) if whole else \
        [f"L{i}" for i in range(space.num_layers)]
    parts = []
    for d, group in itertools.groupby(zip(np.asarray(assignment).tolist(), labels), key=lambda t: t[0]):
        g = [lab for _, lab in group]
        parts.append(f"{names[d]}: {g[0]}" + (f"–{g[-1]}" if len(g) > 1 else ""))
    return " · ".join(parts)


# ----------------------------------------------------------------------------------------------- training

def level_config(level: str, quick: bool = False, split: str = "fixed"):
    """The Fig. 5 chain config at ``level`` with ``split``; ``quick`` shortens every stage."""
    from jmsnas.configs import load_config
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    cfg = load_config(f"{FIG5_CONFIG}:chain:{level}")
    cfg.split = split
    if quick:
        cfg.search.warmup_epochs, cfg.search.epochs, cfg.retrain.epochs = 1, 2, 2
    return cfg


def searched_split_range(space, table) -> tuple:
    """(T_min, T_max) in ms of the latency reachable when the split is searched: min and max over architectures
    of the best-split latency (stem on the UE, head on the cloud).

    For a fixed split T is non-decreasing in every layer's compute latency, so T_min is the minimum over the
    contiguous splits of T(fastest valid op per layer on its device, split). T_max = max over architectures of the
    min over splits; when one op is the slowest valid one at every (device, layer), that architecture is the
    slowest under every split, so T_max is its best-split latency (otherwise ValueError: not computed here).
    """
    from jmsnas.cost.latency import arch_latency
    c = np.asarray(table.compute_ms, np.float64)
    mask, n = space.mask(), space.num_layers
    order = list(space.topology.pre)
    t_min = np.inf
    for a in itertools.combinations_with_replacement(order, n):  # pre is in chain order
        a = np.array(a, np.int32)
        ops = np.argmin(np.where(mask, c[a, np.arange(n)], np.inf), axis=1).astype(np.int32)
        t_min = min(t_min, float(arch_latency(space, table, ops, a).total))
    slow = np.where(mask[None], c, -np.inf)
    worst = np.argmax(slow, axis=2)  # [M, N]
    if not np.all(np.take_along_axis(slow, worst[0][None, :, None], axis=2)[..., 0] == slow.max(axis=2)):
        raise ValueError("no op is the slowest at every device for some layer; T_max is not computed here")
    return t_min, best_jmsnas_split(space, table, worst[0])[0]["total"]


def searched_budget_config(quick: bool = False, fraction: float = 0.5):
    """The chain config with ``split="searched"`` and T_const at ``fraction`` of the searched-split range."""
    from jmsnas import pipeline
    cfg = level_config("mid", quick, "searched")
    probe = level_config("mid", quick, "searched")
    t_min, t_max = searched_split_range(*pipeline.build(probe, pipeline.load_data(probe)))
    cfg.t_const_ms = round(t_min + fraction * (t_max - t_min), 4)
    cfg.experiment.update(dict(name="fig6", level=f"searched-range {fraction:g}", fraction=fraction,
                               reachable_min_ms=t_min, reachable_max_ms=t_max))
    return cfg


def _code_version() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "jmsnas"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" + uncommitted changes in jmsnas/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def run_search(cfg, workdir: str, progress: bool) -> dict:
    """``pipeline.search`` into ``workdir`` unless it holds a result.json; returns the result."""
    from jmsnas import pipeline
    path = os.path.join(workdir, "result.json")
    if not os.path.isfile(path):
        ckpt = os.path.join(workdir, "checkpoints")
        resume = os.path.isdir(ckpt) and any(os.scandir(ckpt))
        t0, version = time.time(), _code_version()
        pipeline.search(cfg, workdir, resume=resume, progress=progress)
        _write_json(os.path.join(workdir, WALL_FILE), {"wall_s": time.time() - t0, "resumed": resume,
                                                        "code": version})
    with open(path) as f:
        return json.load(f)


def train_from_scratch(cfg, ops, workdir: str, progress: bool = True) -> dict:
    """Trains the compact network ``ops`` from a fresh initialisation with the config's retrain budget.

    Same optimiser, learning rate, L2 weight, batch size, epochs and batch order (seed + 2) as stage 2 of
    ``pipeline.search``; the weights come from ``supernet.init(PRNGKey(seed))`` + ``extract`` instead of the
    searched supernet. Writes ``workdir/scratch.json`` {ops, accuracy {val, test}, params, history, wall_s};
    a finished one is read back instead. No checkpoints (a run takes minutes).
    """
    import jax
    import optax
    from tqdm import tqdm

    from jmsnas import data, pipeline, supernet, train
    from jmsnas.space import OP_NAMES

    path = os.path.join(workdir, "scratch.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    os.makedirs(workdir, exist_ok=True)
    t0, version = time.time(), _code_version()
    ds = pipeline.load_data(cfg)
    space, _ = pipeline.build(cfg, ds)
    ops = tuple(int(i) for i in ops)
    params, bn = supernet.init(jax.random.PRNGKey(cfg.seed), space, shared_weights=cfg.shared_weights)
    params, bn = supernet.extract(space, params, bn, ops)
    mesh = train.data_mesh()
    rt = train.replicate(train.RetrainState(params, bn, optax.adam(cfg.retrain.lr).init(params),
                                            jax.numpy.zeros((), jax.numpy.int32)), mesh)
    train_step, eval_step = train.make_retrain_steps(space, ops, cfg.retrain.lr, cfg.search.lambda1, cfg.dw_impl)
    bs = cfg.search.batch_size
    ev = lambda split: train.evaluate(lambda x, y, v: eval_step(rt.params, rt.bn, x, y, v), split,
                                      cfg.eval_batch_size, mesh)[0]
    history = []
    bar = tqdm(total=cfg.retrain.epochs * data.num_batches(ds.train, bs), disable=not progress, desc="scratch")
    for epoch in range(cfg.retrain.epochs):
        for x, y in data.epoch_batches(ds.train, bs, seed=cfg.seed + 2, epoch=epoch):
            rt, m = train_step(rt, *train.shard_batch((x, y), mesh))
            bar.update(1)
        history.append({"epoch": epoch, "train_loss": float(m["loss"]), "train_acc": float(m["acc"]),
                        "val_acc": ev(ds.val)})
    bar.close()
    out = {"ops": [OP_NAMES[i] for i in ops], "accuracy": {"val": ev(ds.val), "test": ev(ds.test)},
           "params": supernet.count_params(jax.device_get(rt.params)), "history": history,
           "epochs": cfg.retrain.epochs, "wall_s": time.time() - t0, "code": version}
    _write_json(path, out)
    return out


# ----------------------------------------------------------------------------------------------- rows

def _ops_of(result) -> np.ndarray:
    from jmsnas.space import op_index
    return np.array([op_index(a["op"]) for a in result["architecture"]], np.int32)


def network_rows(space, table, name: str, ops, accuracy: dict, t_const, splits, short: str | None = None) -> list:
    """Table rows of one trained network under the deployments in ``splits`` (a subset of
    "fixed", "chain_dp", "chain_dp_free", "cloud"); ``short`` labels its points in the plot (default ``name``)."""
    rows = []
    for split in splits:
        if split == "fixed":
            lat, how = jmsnas_split(space, table, ops), "D^m (2 layers per device)"
        elif split == "chain_dp":
            lat, a = best_jmsnas_split(space, table, ops)
            how = "chain DP, stem on UE, head on cloud: " + split_text(space, a)
        elif split == "chain_dp_free":
            lat, a = free_split(space, table, ops)
            how = "chain DP over stem+layers+head: " + split_text(space, a, whole=True)
        elif split == "cloud":
            lat, how = cloud_computing(space, table, ops), "raw image uploaded, all on cloud"
        else:
            raise ValueError(f"unknown deployment {split!r}")
        rows.append({"network": name, "short": short or name, "deployment": split, "how": how,
                     "t_const_ms": t_const, "latency_ms": lat, "accuracy": dict(accuracy)})
    return rows


def reference_rows(topo_name: str = "chain") -> list:
    """Zoo MobileNetV1/V2/V3-Large at 224x224x3 on the chain: cloud-only, edge-only, chain DP (latency only)."""
    from jmsnas import topology
    from jmsnas.split import compare, zoo
    topo = topology.resolve(topo_name)
    rows = []
    for name in ("mobilenet_v1", "mobilenet_v2", "mobilenet_v3_large"):
        setup = compare.make_setup(zoo.get(name), topo)
        for method in ("edge_only", "cloud_only", "chain_dp"):
            r = compare.run_method(setup, method)
            busy = [topo.device_names[d] for d in dict.fromkeys(np.asarray(r.assignment).tolist())]
            rows.append({"network": name, "method": method, "latency_ms": _from_split_result(r),
                         "devices": busy, "memory_ok": r.feasible, "top1_published": PUBLISHED_TOP1[name]})
    return rows


# ----------------------------------------------------------------------------------------------- report

def _fmt_breakdown(lat: dict) -> tuple:
    dev = " / ".join(f"{v:.3f}" for v in lat["per_device"].values())
    link = " / ".join(f"{v:.3f}" for v in lat["per_link"].values())
    return dev, link


def table_markdown(rows, device_names, link_names) -> str:
    head = (f"| network | deployment | T_const | latency | compute {' / '.join(device_names)} | "
            f"links {' / '.join(link_names)} | test acc | val acc |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dev, link = _fmt_breakdown(r["latency_ms"])
        t = "–" if r["t_const_ms"] is None else f"{r['t_const_ms']:.4f}"
        acc = r["accuracy"]
        lines.append(f"| {r['network']} | {r['how']} | {t} | **{r['latency_ms']['total']:.4f}** | {dev} | {link} | "
                     f"{100 * acc['test']:.1f}% | {100 * acc['val']:.1f}% |")
    return "\n".join(lines)


def reference_markdown(rows, device_names, link_names) -> str:
    lines = [f"| network (224×224×3) | method | latency | devices used | compute {' / '.join(device_names)} | "
             f"links {' / '.join(link_names)} | memory fits | published ImageNet top-1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dev, link = _fmt_breakdown(r["latency_ms"])
        lines.append(f"| {r['network']} | {r['method']} | **{r['latency_ms']['total']:.2f}** | "
                     f"{' → '.join(r['devices'])} | {dev} | {link} | {'yes' if r['memory_ok'] else 'NO'} | "
                     f"{r['top1_published']:.1f}% |")
    return "\n".join(lines)


GROUPS = {"fixed": "fixed split D^m", "searched": "searched split (as found by the search)",
          "chain_dp": "chain DP (stem UE, head cloud)",
          "chain_dp_free": "chain DP, whole network", "cloud": "cloud computing (raw input uploaded)"}


def plot_points(rows) -> list:
    """Points for ``report.plot_accuracy_latency``: test accuracy against total latency, grouped by deployment."""
    return [{"label": r["short"], "latency_ms": r["latency_ms"]["total"], "accuracy": r["accuracy"]["test"],
             "group": GROUPS[r["deployment"]]} for r in rows]


def label_clusters(points, dx_log10: float = 0.05, dy: float = 0.001) -> list:
    """[((latency, accuracy), "a, b"), ...]: the labels of points that would print on top of each other (within
    ``dx_log10`` decades and ``dy`` accuracy) joined into one, at the first point's position."""
    clusters = []
    for p in points:
        x, y = p["latency_ms"], p["accuracy"]
        for c in clusters:
            if abs(np.log10(c[0][0]) - np.log10(x)) <= dx_log10 and abs(c[0][1] - y) <= dy:
                if p["label"] not in c[1]:
                    c[1].append(p["label"])
                break
        else:
            clusters.append(((x, y), [p["label"]]))
    return [(xy, ", ".join(labels)) for xy, labels in clusters]


def plot(rows, path: str):
    """The accuracy-latency figure: ``report.plot_accuracy_latency`` on a log latency axis (cloud computing is
    tens of times faster than any split here), without its joining lines (they would join different networks)
    and with overlapping labels merged."""
    from jmsnas import report
    points = plot_points(rows)
    fig = report.plot_accuracy_latency(points, path, "Fig. 6 at our scale: chain preset, digits "
                                       "(test accuracy; 270 test images, one image = 0.37 pp)")
    fig.set_size_inches(10, 6)
    ax = fig.axes[0]
    for artist in list(ax.lines) + list(ax.texts):
        artist.remove()
    for (x, y), text in label_clusters(points):
        ax.annotate(text, (x, 100 * y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency per image (ms, log scale)")
    ax.legend(fontsize=8, loc="lower center")
    fig.savefig(path, dpi=110, format="png")
    return fig


# ----------------------------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="run folder (default runs/fig6, runs/fig6_quick with --quick)")
    p.add_argument("--fig5", default="runs/fig5", help="where finished Fig. 5 chain runs are reused from")
    p.add_argument("--results", default=None, help="where fig6.png goes (default experiments/results; "
                                                   "the run folder with --quick)")
    p.add_argument("--quick", action="store_true", help="short trainings (smoke run)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.out = args.out or ("runs/fig6_quick" if args.quick else "runs/fig6")
    args.results = args.results or (args.out if args.quick else os.path.join(HERE, "results"))
    return args


def _level_workdir(args, level: str) -> str:
    """runs/fig5/chain_<level> when finished there, else <out>/chain_<level> (resumed if it holds a checkpoint).
    Refuses to start afresh a level whose Fig. 5 run is unfinished: two copies would only halve each one's speed."""
    reuse, here = os.path.join(args.fig5, f"chain_{level}"), os.path.join(args.out, f"chain_{level}")
    if args.quick or not args.fig5:
        return here
    for workdir in (reuse, here):
        if os.path.isfile(os.path.join(workdir, "result.json")):
            return workdir
    if os.path.isdir(reuse) and not os.path.isdir(here):
        raise SystemExit(f"{reuse} holds an unfinished Fig. 5 run; let experiments/fig5.py finish it, copy it to "
                         f"{here} to resume it here, or pass --fig5 '' to run every level here")
    return here


def train_all(args, space, progress: bool):
    """Every training this figure needs (each skipped when finished): the three levels, the fixed/searched pair
    at the middle level, the MobileNets and the mid network from scratch. Returns (levels, pair, scratch):
    {level: (cfg, result, workdir)}, {split: (cfg, result, workdir)}, {name: (ops, scratch result)}."""
    levels, pair, scratch = {}, {}, {}
    for level in LEVELS:
        cfg, workdir = level_config(level, args.quick), _level_workdir(args, level)
        print(f"== JMSNAS chain:{level} (T_const {cfg.t_const_ms} ms) <- {workdir}", flush=True)
        levels[level] = (cfg, run_search(cfg, workdir, progress), workdir)
    for split in ("fixed", "searched"):
        cfg, workdir = level_config("mid", args.quick, split), os.path.join(args.out, f"mid_{split}")
        print(f"== JMSNAS chain:mid split={split} -> {workdir}", flush=True)
        pair[split] = (cfg, run_search(cfg, workdir, progress), workdir)
    cfg, workdir = searched_budget_config(args.quick), os.path.join(args.out, "mid_searched_rebudget")
    print(f"== JMSNAS chain split=searched, T_const {cfg.t_const_ms} ms (middle of the searched-split range) -> "
          f"{workdir}", flush=True)
    pair["searched_rebudget"] = (cfg, run_search(cfg, workdir, progress), workdir)
    todo = {name: mobilenet_ops(space, blocks) for name, blocks in BASELINES.items()}
    todo["mid_fixed_scratch"] = tuple(_ops_of(pair["fixed"][1]))
    for name, ops in todo.items():
        print(f"== {name} from scratch -> {args.out}/{name}", flush=True)
        scratch[name] = (ops, train_from_scratch(level_config("mid", args.quick), ops, os.path.join(args.out, name),
                                                 progress))
    return levels, pair, scratch


def _same_run(a: dict, b: dict) -> bool:
    keys = ("architecture", "latency_ms", "accuracy", "params")
    return all(a[k] == b[k] for k in keys)


def all_rows(space, table, levels, pair, scratch) -> list:
    """Every table row: the levels (D^m, cloud; the mid one also re-split by the DP), the searched-split run (as
    found, cloud), the fixed-split rerun unless it reproduced the Fig. 5 mid run exactly, the baselines."""
    rows = []
    mid_same = _same_run(levels["mid"][1], pair["fixed"][1])
    for level, (cfg, result, _) in levels.items():
        name = f"JMSNAS {level}" + (" (= fixed-split rerun)" if level == "mid" and mid_same else "")
        splits = ["fixed", "chain_dp", "cloud"] if level == "mid" and mid_same else ["fixed", "cloud"]
        rows += network_rows(space, table, name, _ops_of(result), result["accuracy"], cfg.t_const_ms, splits,
                             short=level)
    if not mid_same:
        cfg, result, _ = pair["fixed"]
        rows += network_rows(space, table, "JMSNAS mid, fixed-split rerun", _ops_of(result), result["accuracy"],
                             cfg.t_const_ms, ["fixed", "chain_dp", "cloud"], short="mid rerun")
    for key, name, short in (("searched", "JMSNAS mid, searched split", "searched"),
                             ("searched_rebudget", "JMSNAS searched split, T_const mid of its own range",
                              "searched, own budget")):
        if key in pair:
            rows += _searched_rows(space, table, name, short, *pair[key][:2])
    for name, (ops, res) in scratch.items():
        if name in BASELINES:
            rows += network_rows(space, table, f"{name} (ours, scratch)", ops, res["accuracy"], None,
                                 ["chain_dp", "chain_dp_free", "cloud"], short=SHORT[name])
        else:
            rows += network_rows(space, table, "JMSNAS mid net, retrained from scratch", ops, res["accuracy"], None,
                                 ["fixed"], short="mid, scratch")
    return rows


def _searched_rows(space, table, name, short, cfg, result) -> list:
    """A searched-split run priced at the split it found (its result's devices), and as cloud computing."""
    ops = _ops_of(result)
    a = np.array([space.topology.device_names.index(x["device"]) for x in result["architecture"]], np.int32)
    rows = network_rows(space, table, name, ops, result["accuracy"], cfg.t_const_ms, ["chain_dp", "cloud"], short)
    rows[0].update(how="searched split (as found): " + split_text(space, a), deployment="searched",
                   latency_ms=jmsnas_split(space, table, ops, a))
    return rows


def wall_markdown(levels, pair, scratch) -> str:
    lines = ["| run | wall time | code |", "|---|---|---|"]
    for name, (_, _, workdir) in [(f"chain:{k}", v) for k, v in levels.items()] + \
            [(f"pair: {k}", v) for k, v in pair.items()]:
        w = _wall(workdir) or {}
        t = "?" if w.get("wall_s") is None else f"{w['wall_s'] / 60:.1f} min"
        code = w.get("code", "see " + workdir)
        code = "; ".join(code) if isinstance(code, list) else code
        t += " (resumed)" if w.get("resumed") else ""
        lines.append(f"| {name} ({workdir}) | {t} | {code} |")
    for name, (_, res) in scratch.items():
        lines.append(f"| {name}, {res['epochs']} epochs from scratch | {res['wall_s'] / 60:.1f} min | {res['code']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from jmsnas import pipeline
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.results, exist_ok=True)
    cfg = level_config("mid", args.quick)
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    levels, pair, scratch = train_all(args, space, not args.no_progress)
    rows, ref = all_rows(space, table, levels, pair, scratch), reference_rows()
    data = {"rows": rows, "reference": ref, "mid_rerun_identical": _same_run(levels["mid"][1], pair["fixed"][1]),
            "runs": {**{k: v[2] for k, v in levels.items()}, **{f"mid_{k}": v[2] for k, v in pair.items()}},
            "scratch": {k: {kk: vv for kk, vv in v[1].items() if kk != "history"} for k, v in scratch.items()},
            "report_wall_s": time.time() - t_start}
    _write_json(os.path.join(args.out, "fig6_data.json"), data)
    plot(rows, os.path.join(args.results, "fig6.png"))
    names, links = space.topology.device_names, space.topology.link_names
    tables = "\n\n".join([table_markdown(rows, names, links), reference_markdown(ref, names, links),
                           wall_markdown(levels, pair, scratch)]) + "\n"
    with open(os.path.join(args.out, "fig6_tables.md"), "w") as f:
        f.write(tables)
    print(tables)
    print(f"wrote {args.out}/fig6_data.json, {args.out}/fig6_tables.md and {args.results}/fig6.png")
    return 0


def _wall(workdir: str):
    for name in (WALL_FILE, "fig5_wall.json"):
        path = os.path.join(workdir, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return None


if __name__ == "__main__":
    sys.exit(main())
