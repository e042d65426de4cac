"""Paper 004 at our scale: Table 5 (accuracy and transmitted data relative to the non-separated network for
separable, + sparsity, + float16) and Fig. 4 (controller vs random sampler) on the embedded digits.

Runs ``jmsnas.separable.search`` for each variant of ``experiments/configs/separable.py`` (the same code path as
``jmsnas separable``) into ``--runs`` (a finished variant is read back, not rerun), then writes
``experiments/results/separable_table5.md`` and ``experiments/results/separable_fig4.png``.

Run: python experiments/separable.py [--seeds 0,1,2] [--variants g2a1,g2a2,g4a1,g4a2,g4a2k9,g4a2k9f16]
     [--augment-shift N] [--runs DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np
from matplotlib.figure import Figure

from jmsnas.separable import search

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("g2a1", "g2a2", "g4a1", "g4a2", "g4a2k9", "g4a2k9f16")
CONTROL = "random_on_controller_weights"  # section 4.5's control group (jmsnas.separable.search)


def _config(arg):
    spec = importlib.util.spec_from_file_location("separable_cfg", os.path.join(HERE, "configs", "separable.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def run_variant(name, runs, seed=0, augment_shift=None):
    wd = os.path.join(runs, name if seed == 0 else f"{name}_seed{seed}")
    if os.path.isfile(os.path.join(wd, "result.json")):
        with open(os.path.join(wd, "result.json")) as f:
            res = json.load(f)
    else:
        t0 = time.time()
        cfg = _config(name)
        cfg.seed = seed
        if augment_shift is not None:
            cfg.search.augment_shift = augment_shift
        res = search.search(cfg, wd, progress=False)
        res["wall_s"] = time.time() - t0
        with open(os.path.join(wd, "result.json"), "w") as f:
            json.dump(res, f, indent=2)
    with open(os.path.join(wd, "history.json")) as f:
        return res, json.load(f)


def label(res):
    n = res["network"]
    s = f"Sep-ResNeXt (G={n['G']}, α={n['alpha']})"
    if n["K"] > 1:
        s += f" + sparsification (K={n['K']})"
    if n["float16"]:
        s += " + float16"
    return s


def steps_ratio(res, arm) -> float:
    """Bytes of the transmission steps only (the stem broadcast, the same in both, left out) relative to the
    non-separated network's all-reduces."""
    c = res[arm]["cost"]
    steps = sum(s["bytes"] for s in c["steps"])
    bcast = c["bytes_per_image"] - steps
    return steps / (c["reference_bytes"] - bcast)


def table(results) -> str:
    lines = ["| run | method | test acc. (controller) | comm. (controller) | comm. excl. stem broadcast | "
             "test acc. (random) | comm. (random) | last-round mean val. reward controller / random | "
             "latency ms (overlap / sync) | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    seen_ref = set()
    for name, (res, _) in results.items():
        g = res["network"]["G"]
        key = (g, name.partition("_")[2])  # one reference row per G and seed
        if key not in seen_ref and "reference" in res:
            seen_ref.add(key)
            lines.append(f"| {name} | ResNeXt, non-separated, ring all-reduce over G={g} | "
                         f"{100 * res['reference']['test_acc']:.2f}% | 100.00% | 100.00% | | | | | |")
        c, r, rs = res["controller"], res["random"], res["reward_summary"]
        lines.append(f"| {name} | {label(res)} | {100 * c['test_acc']:.2f}% | {100 * c['cost']['bytes_ratio']:.2f}% | "
                     f"{100 * steps_ratio(res, 'controller'):.2f}% | "
                     f"{100 * r['test_acc']:.2f}% | {100 * r['cost']['bytes_ratio']:.2f}% | "
                     f"{rs['controller']['last_round_mean_reward']:.3f} / {rs['random']['last_round_mean_reward']:.3f} | "
                     f"{c['cost']['latency_ms']:.2f} / {c['cost']['synchronous_ms']:.2f} | "
                     f"{res.get('wall_s', float('nan')):.0f} |")
    return "\n".join(lines)


def decisions(results) -> str:
    lines = ["| run | controller's best decisions [perm id, level] | random sampler's best |", "|---|---|---|"]
    for name, (res, _) in results.items():
        f = lambda d: str([[p, l] for p, l in zip(d["perm_ids"], d["levels"])]) if res["network"]["K"] > 1 \
            else str(d["perm_ids"])
        lines.append(f"| {name} | {f(res['controller']['decisions'])} | {f(res['random']['decisions'])} |")
    return "\n".join(lines)


def _wins(rs, other: str, key: str) -> int:
    """Runs whose controller's mean validation reward (``key``: last round or all steps) is above ``other``'s."""
    return sum(x["controller"][key] > x[other][key] for x in rs)


def summary(results) -> str:
    """Per variant over its seeds: mean test accuracy and bytes of both arms, and in how many runs the
    controller's mean validation reward was above the random sampler's and above the control group's (uniform
    decisions on the controller's network; last round, and over all steps)."""
    by = {}
    for name, (res, _) in results.items():
        by.setdefault(name.partition("_")[0], []).append(res)
    lines = ["| variant | method | seeds | test acc. controller (mean, min-max) | test acc. random | "
             "comm. controller | comm. random | controller > random sampler: last round / all steps | "
             "mean val. reward, last round: controller / random | controller > control group: last round / "
             "all steps | mean val. reward, last round: control group |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ref_done = set()
    for v, runs in by.items():
        g = runs[0]["network"]["G"]
        if g not in ref_done and all("reference" in r for r in runs):
            ref_done.add(g)
            ref = [100 * r["reference"]["test_acc"] for r in runs]
            lines.append(f"| ResNeXt G={g} | non-separated, ring all-reduce | {len(runs)} | {np.mean(ref):.2f}% "
                         f"({min(ref):.2f}-{max(ref):.2f}) | | 100.00% | | | | | |")
        acc = {a: [100 * r[a]["test_acc"] for r in runs] for a in ("controller", "random")}
        comm = {a: np.mean([100 * r[a]["cost"]["bytes_ratio"] for r in runs]) for a in ("controller", "random")}
        rs = [r["reward_summary"] for r in runs]
        last, allr = _wins(rs, "random", "last_round_mean_reward"), _wins(rs, "random", "mean_reward")
        lc = np.mean([x["controller"]["last_round_mean_reward"] for x in rs])
        lr = np.mean([x["random"]["last_round_mean_reward"] for x in rs])
        control = " | |"
        if all(CONTROL in x for x in rs):
            control = (f" {_wins(rs, CONTROL, 'last_round_mean_reward')}/{len(runs)} / "
                       f"{_wins(rs, CONTROL, 'mean_reward')}/{len(runs)} | "
                       f"{np.mean([x[CONTROL]['last_round_mean_reward'] for x in rs]):.3f} |")
        lines.append(f"| {v} | {label(runs[0])} | {len(runs)} | {np.mean(acc['controller']):.2f}% "
                     f"({min(acc['controller']):.2f}-{max(acc['controller']):.2f}) | {np.mean(acc['random']):.2f}% | "
                     f"{comm['controller']:.2f}% | {comm['random']:.2f}% | {last}/{len(runs)} / {allr}/{len(runs)} | "
                     f"{lc:.3f} / {lr:.3f} |" + control)
    return "\n".join(lines)


def fig4(results, path):
    names = list(results)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, sharey=True)).reshape(-1)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes, names):
        res, hist = results[name]
        for arm, color in (("controller", "#1f77b4"), ("random", "#ff7f0e")):
            r = np.array([v for h in hist for v in h[arm]["rewards"]])
            ax.plot(np.arange(1, r.size + 1), 100 * r, color=color, lw=1,
                    label="LSTM controller" if arm == "controller" else "random sampler")
        if all(CONTROL in h["controller"] for h in hist):
            r = np.array([v for h in hist for v in h["controller"][CONTROL]])
            ax.plot(np.arange(1, r.size + 1), 100 * r, color="#999999", lw=1,
                    label="control group: random decisions\non the controller's network")
        ax.set_title(f"{name}: " + label(res).replace("Sep-ResNeXt ", ""), fontsize=8)
        ax.set_xlabel("controller step")
    for i in range(0, len(names), cols):
        axes[i].set_ylabel("mean validation accuracy (%)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=110, format="png")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--runs", default="runs/separable")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; the table shows each run")
    ap.add_argument("--augment-shift", type=int, default=None,
                    help="search.augment_shift for every run (default: the config's, 1); another value names the "
                         "outputs separable_table5_shift<N>.md and separable_fig4_shift<N>.png")
    a = ap.parse_args()
    results = {}
    for seed in (int(x) for x in a.seeds.split(",")):
        for v in a.variants.split(","):
            results[v if seed == 0 else f"{v}_seed{seed}"] = run_variant(v, a.runs, seed, a.augment_shift)
    os.makedirs(a.out, exist_ok=True)
    suffix = "" if a.augment_shift is None else f"_shift{a.augment_shift}"
    with open(os.path.join(a.out, f"separable_table5{suffix}.md"), "w") as f:
        f.write(summary(results) + "\n\n" + table(results) + "\n\n" + decisions(results) + "\n")
    fig4(results, os.path.join(a.out, f"separable_fig4{suffix}.png"))
    print(summary(results))
    print()
    print(table(results))
    print()
    print(decisions(results))


if __name__ == "__main__":
    main()
