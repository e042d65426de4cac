"""The composed search against each paper's mechanism alone: accuracy-latency fronts on the paper's chain.

Four methods over a range of T_const, each over several seeds, on the paper's chain with Table I links (the README's
main job with only the method's switches, T_const and the seed changed; ``experiments/configs/composed.py``):

* (a) ``jmsnas``: JMSNAS alone;
* (b) ``autosplit``: JMSNAS, then Auto-Split (``jmsnas.quant.autosplit``, the code of ``jmsnas autosplit``) on that
  run's network: of every candidate split and bit-width assignment Auto-Split lists (Algorithm 1 and its latency
  variants), the one with the least accuracy drop on the validation split whose latency (Auto-Split's own model:
  the UE up to the split at the chosen bits, the tensor relayed over the links, the cloud in float16) is within
  T_const and whose UE part fits the UE's memory. Below JMSNAS's reach it starts from the run at the tightest
  budget JMSNAS meets. It searches nothing new;
* (c) ``module``: JMSNAS with a fixed split module (r = 4) at every cut;
* (d) ``composed``: ops, the split (the input image sendable, the stem moving with it), modules, weight bits and
  transmitted bits searched together.

A budget below a method's least reachable T (the exact repair at T_const = 0 of its space) is not run: the method
cannot meet it. Also at T_const = 2.8 ms with the UE's memory at 80,000 bytes (``ue80k``), below what (a) needs
unconstrained: (a), (b) and (d).

Writes into ``--out`` (default ``runs/composed``): each run's workdir ``<method>_<T>_s<seed>[_ue80k]`` (a finished
run is skipped, an interrupted one resumed, so the command can simply be started again), ``composed.json`` (every
row), ``composed.md`` (the tables) and ``composed.png`` (the fronts).

Usage:
  python experiments/composed.py [--out runs/composed] [--budgets 0.08 0.4 1.2 2.0 2.6 2.8] [--seeds 0 1 2]
                                 [--no-memory] [--quick]
``--quick``: 1 warm-up + 2 search epochs and 2 retrain epochs (a smoke run; default out ``runs/composed_quick``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import time

import numpy as np
from matplotlib.figure import Figure

from jmsnas.run.directory import read_result

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS = (0.08, 0.4, 1.2, 2.0, 2.6, 2.8)
SEARCHED = ("jmsnas", "module", "composed")
LABELS = {"jmsnas": "(a) JMSNAS alone", "autosplit": "(b) JMSNAS then Auto-Split",
          "autosplit_ue": "(b') (b), the UE keeping its layers",
          "module": "(c) JMSNAS + fixed module r=4", "composed": "(d) composed search"}
MEMORY_BUDGET = 2.8
MEMORY_SEARCHED = ("jmsnas", "composed")  # (b) comes from (a)'s run; (c) is left out of the memory case
AUTOSPLIT_BITS = (2, 4, 6, 8, 16)


def _configs():
    spec = importlib.util.spec_from_file_location("composed_config", os.path.join(HERE, "configs", "composed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def config(method: str, t_const: float, seed: int, ue80k: bool, quick: bool):
    cfg = _configs().get_config(f"{method}:{t_const:g}:{seed}" + (":ue80k" if ue80k else ""))
    if quick:
        cfg.search.warmup_epochs, cfg.search.epochs, cfg.retrain.epochs = 1, 2, 2
    return cfg


def reach(method: str) -> float:
    """The least T (ms) any configuration of the method's space reaches under its split (D^m, or any split where
    the method searches it; exact repair)."""
    import jax.numpy as jnp
    from jmsnas import pipeline
    from jmsnas.compose import anysplit, choices as C, flow, repair as R, terms as TT
    cfg = config(method, 2.8, 0, False, False)
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    ch = flow.choices_of(cfg, space.topology)
    logits = C.ChoiceProbs(*(jnp.zeros(s) for s in C.logits_shapes(space, ch)))
    terms = TT.build_terms(space, table, ch, cfg.cost.activation_bits)
    if cfg.split == "searched":
        return float(anysplit.repair_any_split(space, table, terms, ch, logits, 0.0)[0].min_latency_ms)
    return float(R.repair(space, table, terms, ch, logits, 0.0).min_latency_ms)


def workdir(out, method, t_const, seed, ue80k) -> str:
    return os.path.join(out, f"{method}_{t_const:g}_s{seed}" + ("_ue80k" if ue80k else ""))


def search(out, method, t_const, seed, ue80k, quick) -> dict:
    from jmsnas import pipeline
    wd = workdir(out, method, t_const, seed, ue80k)
    if not os.path.isfile(os.path.join(wd, "result.json")):
        ckpt = os.path.join(wd, "checkpoints")
        t0 = time.time()
        pipeline.search(config(method, t_const, seed, ue80k, quick), wd,
                        resume=os.path.isdir(ckpt) and any(os.scandir(ckpt)), progress=False)
        print(f"  {os.path.basename(wd)}: {time.time() - t0:.0f} s", flush=True)
    r = read_result(wd)
    c = r.get("compose") or {}
    return {"method": method, "t_const_ms": t_const, "seed": seed, "ue80k": ue80k, "run": wd,
            "met": bool(r["budget"]["met"]) and all(m["within"] for m in r["memory"].values()),
            "latency_ms": r["latency_ms"]["total"], "test_acc": r["accuracy"]["test"], "val_acc": r["accuracy"]["val"],
            "ue_bytes": r["memory"]["ue"]["bytes"], "params": r["params"],
            "modules": c.get("modules"), "weight_bits": c.get("weight_bits"), "activation_bits": c.get("activation_bits")}


def _ue_units(ctx, source) -> int:
    """The units of the folded network (``jmsnas.quant.network``: stem, each layer's convolutions, head) that the
    UE runs under the run's own split: everything before the first unit of a layer on another device."""
    arch = read_result(source["run"])["architecture"]
    first = arch[0]["device"]
    ue_layers = {f"layer{e['layer']}." for e in arch if e["device"] == first}
    names = [u.name for u in ctx["run"].net.units]
    return next(i for i, n in enumerate(names) if i > 0 and not any(n.startswith(p) for p in ue_layers))


def autosplit_rows(source: dict, budgets) -> list:
    """(b) Auto-Split on ``source``'s run: at every T_const of ``budgets``, the candidate with the least validation
    drop within T_const and the UE's memory (its topology's ``memory_bytes``); and (b') the same among the
    candidates that keep at least the UE's layers of the run on the UE (split n at or after the run's UE cut: no
    cloud-only)."""
    from jmsnas.quant import autosplit as AS, solver
    from jmsnas.topology import resolve
    topo = resolve(_configs().UE80K if source["ue80k"] else "chain")
    ue_memory = float(topo.devices[0].memory_bytes)
    prob, drop, ctx = AS.prepare(source["run"], topo, ue_memory, AUTOSPLIT_BITS, "val")
    cands = [s for s in solver.candidates(prob) if s.edge_memory_bytes <= ue_memory]
    n_ue = _ue_units(ctx, source)
    units = len(ctx["run"].net.units)
    rows = []
    for t_const in budgets:
        for method, least in (("autosplit", 0), ("autosplit_ue", n_ue)):
            mine = [s for s in cands if s.split >= least]
            ok = [s for s in mine if s.latency_ms <= t_const]
            row = {"method": method, "t_const_ms": t_const, "seed": source["seed"], "ue80k": source["ue80k"],
                   "run": source["run"], "source_t_const_ms": source["t_const_ms"], "met": bool(ok),
                   "least_split": least, "least_latency_ms": min((s.latency_ms for s in mine), default=None)}
            if ok:
                best = min(ok, key=lambda s: (drop(s), s.latency_ms))
                acc = {k: ctx["acc"](split, best) for k, split in ctx["eval"].items()}
                wb, ab = best.bit_arrays(units)
                row.update(latency_ms=best.latency_ms, test_acc=acc["test"], val_acc=acc["val"], split=best.split,
                           weight_bits=[int(b) for b in wb[: best.split]],
                           activation_bits=[int(b) for b in ab[: best.split]], sent_bytes=int(best.sent_bytes),
                           ue_bytes=int(best.edge_memory_bytes))
            rows.append(row)
    return rows


def _mean_sd(rows, key="test_acc"):
    v = np.array([r[key] for r in rows], float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


ALL = ("jmsnas", "autosplit", "autosplit_ue", "module", "composed")


def _cell(rows, method, budget, ue80k=False):
    """The rows of one method at one budget if every seed met it, else None."""
    got = [r for r in rows if r["method"] == method and r["t_const_ms"] == budget and r["ue80k"] == ue80k]
    return got if got and all(r["met"] for r in got) else None


def _verdict(d, others) -> tuple:
    """((d) minus the best of ``others`` in points, whether (d)'s mean + sd reaches that one's mean - sd)."""
    best = max(((_mean_sd(o), m) for m, o in others.items() if o is not None), default=None, key=lambda x: x[0][0])
    if d is None:
        return "", "(d) does not meet it" if best is not None else "none meets it"
    if best is None:
        return "", "only (d) meets it"
    (mu_b, sd_b), m = best
    mu, sd = _mean_sd(d)
    return f"{100 * (mu - mu_b):+.2f} pts vs {m}", "yes" if mu + sd >= mu_b - sd_b else "no"


def tables(rows, reaches, budgets, seeds) -> list:
    """Markdown: the fronts (mean +- sd of test accuracy over the seeds, mean T) and the comparisons."""
    head = ("| T_const (ms) | " + " | ".join(LABELS[m] for m in ALL)
            + " | (d) - best of (a), (b'), (c) | holds | (d) - (b) | holds |")
    lines = [head, "|---" * (len(ALL) + 5) + "|"]
    for b in budgets:
        cells = []
        for m in ALL:
            got = _cell(rows, m, b)
            if got is None:
                least = reaches.get(m)
                cells.append(f"cannot meet (least {least:.3f} ms)" if least is not None and b < least else "not met")
                continue
            mu, sd = _mean_sd(got)
            cells.append(f"{100 * mu:.2f} ± {100 * sd:.2f}% (T {np.mean([r['latency_ms'] for r in got]):.3f})")
        d = _cell(rows, "composed", b)
        same = _verdict(d, {m: _cell(rows, m, b) for m in ("jmsnas", "autosplit_ue", "module")})
        vs_b = _verdict(d, {"autosplit": _cell(rows, "autosplit", b)})
        lines.append(f"| {b:g} | " + " | ".join(cells) + f" | {same[0]} | {same[1]} | {vs_b[0]} | {vs_b[1]} |")
    lines.append("")
    lines.append(f"Test accuracy, mean ± sample sd over seeds {list(seeds)}; T (ms): the mean latency of the results "
                 "(eq. (1) for (a), (c), (d); Auto-Split's own model for (b), (b')). 'holds': (d)'s mean + sd "
                 "reaches the other's mean - sd. 'least': the least T the method reaches (the exact repair at "
                 "T_const = 0; for (b), (b') the fastest Auto-Split candidate).")
    return lines


def memory_table(rows) -> list:
    lines = ["| method | met (seeds) | test acc | T (ms) | UE bytes (limit 80,000) |", "|---|---|---|---|---|"]
    for m in ALL:
        got = [r for r in rows if r["method"] == m and r["ue80k"]]
        if not got:
            continue
        met = [r for r in got if r["met"]]
        if len(met) < len(got):
            lines.append(f"| {LABELS[m]} | {len(met)}/{len(got)} | | | |")
            continue
        mu, sd = _mean_sd(met)
        lines.append(f"| {LABELS[m]} | {len(met)}/{len(got)} | {100 * mu:.2f} ± {100 * sd:.2f}% | "
                     f"{np.mean([r['latency_ms'] for r in met]):.3f} | "
                     f"{int(np.mean([r['ue_bytes'] for r in met])):,} |")
    return lines


def plot(rows, budgets, path) -> None:
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    for m, marker in zip(ALL, "osvD^"):
        xs, mus, sds, ts = [], [], [], []
        for b in budgets:
            got = _cell(rows, m, b)
            if got is not None:
                mu, sd = _mean_sd(got)
                xs.append(b), mus.append(100 * mu), sds.append(100 * sd)
                ts.append(np.mean([r["latency_ms"] for r in got]))
        if xs:
            ax.errorbar(xs, mus, yerr=sds, fmt=marker + "-", capsize=3, label=LABELS[m])
            ax2.plot(xs, ts, marker + "-", label=LABELS[m])
    ax.set_xlabel("T_const (ms)")
    ax.set_ylabel("test accuracy (%), mean ± sd over seeds")
    ax.legend(fontsize=7)
    lim = [0, max(budgets) * 1.05]
    ax2.plot(lim, lim, color="#888", lw=0.8, ls=":", label="T = T_const")
    ax2.set_xlabel("T_const (ms)")
    ax2.set_ylabel("latency of the result (ms)")
    ax2.legend(fontsize=7)
    fig.suptitle("Composed search vs each mechanism alone (paper's chain, Table I links, digits)")
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--no-memory", action="store_true", help="skip the runs with the UE's memory at 80,000 bytes")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if any(not b > 0 for b in args.budgets) or any(s < 0 for s in args.seeds):
        p.error(f"budgets must be > 0 ms and seeds >= 0, got {args.budgets} and {args.seeds}")
    out = args.out or ("runs/composed_quick" if args.quick else "runs/composed")
    os.makedirs(out, exist_ok=True)
    budgets = sorted(set(args.budgets))
    t0, load = time.time(), os.getloadavg()[0]
    reaches = {m: reach(m) for m in SEARCHED}
    print("least reachable T (ms):", {m: round(v, 4) for m, v in reaches.items()}, flush=True)
    rows = []
    for seed in args.seeds:  # the fronts of every seed first, then the memory case
        for m in SEARCHED:
            for b in budgets:
                if b >= reaches[m]:
                    rows.append(search(out, m, b, seed, False, args.quick))
    for seed in [] if args.no_memory else args.seeds:
        for m in MEMORY_SEARCHED:
            rows.append(search(out, m, MEMORY_BUDGET, seed, True, args.quick))
    for seed in args.seeds:
        a_runs = {r["t_const_ms"]: r for r in rows if r["method"] == "jmsnas" and r["seed"] == seed
                  and not r["ue80k"] and r["met"]}
        if not a_runs:
            continue
        by_source = {}  # below JMSNAS's reach, the run at the tightest budget it meets
        for b in budgets:
            by_source.setdefault(b if b in a_runs else min(a_runs), []).append(b)
        for t, bs in by_source.items():
            rows += autosplit_rows(a_runs[t], bs)
        mem = [r for r in rows if r["method"] == "jmsnas" and r["seed"] == seed and r["ue80k"]]
        if mem:
            rows += autosplit_rows(mem[0], [MEMORY_BUDGET])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    with open(os.path.join(out, "composed.json"), "w") as f:
        json.dump({"reaches_ms": reaches, "rows": rows}, f, indent=1, default=lambda x: x.item())
    for m in ("autosplit", "autosplit_ue"):
        least = [r["least_latency_ms"] for r in rows if r["method"] == m and r["least_latency_ms"] is not None]
        reaches[m] = min(least) if least else None
    text = ["## Fronts", "", *tables(rows, reaches, budgets, args.seeds), "",
            f"## With the UE's memory at 80,000 bytes (T_const = {MEMORY_BUDGET} ms)", "", *memory_table(rows), "",
            f"(code {commit}; {time.time() - t0:.0f} s wall, load average {load:.1f} at the start"
            + ("; --quick" if args.quick else "") + ")"]
    with open(os.path.join(out, "composed.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    plot(rows, budgets, os.path.join(out, "composed.png"))
    print("\n".join(text))


if __name__ == "__main__":
    main()
