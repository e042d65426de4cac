"""SplitNets at our scale (paper 000, Tables 4-6 in spirit): searched SplitNets against the baselines, V = 1 and 4.

For V = 1 and V = 4 (configs ``experiments/configs/splitnets_single.py`` / ``splitnets_multiview.py``):

* the searched SplitNet: ``jmsnas.splitnets.search.evolve`` (sandwich supernet, evolution under latency and sensor
  memory limits, retrain), exactly what ``jmsnas evolve --config ...`` runs;
* baselines on one fixed network (the space's largest: every slot k5 e6, full depth) without a split module,
  trained from scratch for as many epochs as the SplitNet got (supernet + retrain): All-on-sensor (every block on
  the sensor, the head on the aggregator), All-on-aggregator (the raw views sent), Neurosurgeon (the fastest split
  position of that network, latency only, memory reported). With V = 4 the views are averaged where they meet
  (fusion without a module), so each placement is its own network and is trained; with V = 1 the three compute the
  same function and share one training;
* the initialisation ablation: per-layer gradient norms at initialisation (largest network, the split module in
  phase 1, one batch) for geometric / Kaiming fan-in / fan-out, and stage 1 (V = 1) trained with geometric and
  fan-in, same seed and data.

Writes ``<out>/summary.json`` and prints markdown tables. Run:
  python experiments/splitnets.py --out /tmp/splitnets_exp
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jmsnas import train
from jmsnas.run import evolution as RE
from jmsnas.run.supernet import train_supernet
from jmsnas.objectives import cross_entropy
from jmsnas.splitnets import hardware as H
from jmsnas.splitnets import net as N
from jmsnas.splitnets import search as S

HERE = os.path.dirname(os.path.abspath(__file__))


def config(name: str, arg: str = ""):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def grad_norms(cfg, space, ds, mode: str) -> dict:
    """Gradient norm per weight tensor at initialisation: the split module's reduce / recover against the mean of
    the regular blocks' convolutions (largest network, split in phase 1 after its first block, d = c / 8)."""
    params, bn = N.init(jax.random.PRNGKey(cfg.seed), space, mode)
    a = space.decode(space.extreme(True))._replace(split=(1, 1))
    a = a._replace(d=min(space.d_choices(1)))
    genes = jnp.asarray(space.encode(a))
    x, y = ds.train.images[:64], ds.train.labels[:64]
    g = jax.grad(lambda p: cross_entropy(N.apply(space, p, bn, genes, x, train=True)[0], y))(params)
    mod = g["modules"][1]
    blocks = [float(jnp.linalg.norm(b[k])) for b in g["sensor"] for k in ("expand", "project")]
    out = {k: float(jnp.linalg.norm(v)) for k, v in mod.items()}
    out["regular_mean"] = float(np.mean(blocks))
    return out


def baselines(cfg, hw, space, ds, epochs: int) -> list:
    genes = space.extreme(True)
    a = space.decode(genes)
    last = (space.num_phases - 1, space.max_depth)
    places = {"All-on-sensor": last, "All-on-aggregator": (0, 0)}
    options = [(0, 0)] + [pos for pos in space.positions]
    lat = {pos: H.cost(space, a._replace(split=pos), hw, "none").total_ms for pos in options}
    places["Neurosurgeon"] = min(options, key=lambda p: (lat[p], p))
    rows, trained = [], {}
    for name, pos in places.items():
        key = pos if space.views > 1 else "same"
        if key not in trained:
            params, _ = N.init(jax.random.PRNGKey(cfg.seed), space, cfg.splitnets.init)
            t = time.time()
            p, bn, hist, ev = S.train_fixed(cfg, space, ds, params, genes, epochs, RE.fitness_data(cfg, ds).bn,
                                            pos=pos, module="none", lr=cfg.search.weight_lr, progress=False,
                                            desc=name)
            trained[key] = (S.accuracy(ev, p, bn, ds.test), time.time() - t)
        c = H.cost(space, a._replace(split=pos), hw, "none")
        rows.append({"method": name, "position": list(pos), "test_acc": trained[key][0], "total_ms": c.total_ms,
                     "sensor_ms": c.sensor_ms, "comm_ms": c.comm_ms, "aggregator_ms": c.aggregator_ms,
                     "bus_bytes": c.bus_bytes, "sensor_peak_bytes": c.sensor_peak_bytes,
                     "memory_ok": c.sensor_peak_bytes <= hw.sensor_memory_bytes,
                     "latency_ok": c.total_ms <= cfg.t_const_ms, "train_seconds": trained[key][1]})
    return rows


def _us(ms) -> str:
    return f"{ms * 1e3:.2f}"


def markdown(summaries: dict) -> str:
    """The tables of experiments/splitnets.md from the summaries of the V1 and V4 runs."""
    out = ["| V | method | split (phase, m) | d / c | test acc. | T (us) | T_sen / T_comm / T_agg (us) | "
           "bus bytes | sensor peak (bytes) | limits met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tag, summ in sorted(summaries.items()):
        run = summ["runs"][tag]
        for b in run["baselines"]:
            ok = ("yes" if b["memory_ok"] and b["latency_ok"] else
                  "no: " + ", ".join(w for w, f in (("memory", b["memory_ok"]), ("latency", b["latency_ok"])) if not f))
            out.append(f"| {tag[1:]} | {b['method']} (fixed net, no module) | {tuple(b['position'])} | - | "
                       f"{100 * b['test_acc']:.1f}% | {_us(b['total_ms'])} | {_us(b['sensor_ms'])} / "
                       f"{_us(b['comm_ms'])} / {_us(b['aggregator_ms'])} | {b['bus_bytes']:.0f} | "
                       f"{b['sensor_peak_bytes']:.0f} | {ok} |")
        r = run["searched"]
        sn, lat = r["splitnets"], r["latency_ms"]
        out.append(f"| {tag[1:]} | searched SplitNet | ({sn['split_phase']}, {sn['blocks_on_sensor']} blocks on "
                   f"sensor, {sn['blocks_on_aggregator']} on agg.) | {sn['d']} / {sn['c']} | "
                   f"{100 * r['accuracy']['test']:.1f}% | {_us(lat['total'])} | {_us(lat['per_device']['sensor'])} / "
                   f"{_us(lat['per_link']['sensor->aggregator'])} / {_us(lat['per_device']['aggregator'])} | "
                   f"{sn['bus_bytes']:.0f} (no module: {sn['bus_bytes_without_module']:.0f}) | "
                   f"{sn['sensor_peak_memory_bytes']:.0f} | {'yes' if r['budget']['met'] else 'no'} |")
    return "\n".join(out)


def main(argv=None):
    jax.config.update("jax_compilation_cache_dir", os.path.join("/tmp", "jmsnas_splitnets_jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arg", default="", help="config variant ('tiny' for a smoke run)")
    ap.add_argument("--only", choices=("V1", "V4"), default=None, help="run one of the two systems")
    ap.add_argument("--report", action="store_true", help="print the tables of summaryV1/V4.json in --out")
    args = ap.parse_args(argv)
    if args.report:
        summ = {t: json.load(open(os.path.join(args.out, f"summary{t}.json"))) for t in ("V1", "V4")
                if os.path.exists(os.path.join(args.out, f"summary{t}.json"))}
        print(markdown(summ))
        return
    os.makedirs(args.out, exist_ok=True)
    summary, t_all = {"runs": {}}, time.time()
    for tag, name in (("V1", "splitnets_single"), ("V4", "splitnets_multiview")):
        if args.only and tag != args.only:
            continue
        t = time.time()
        res = S.evolve(config(name, args.arg), os.path.join(args.out, tag), progress=False)
        summary["runs"][tag] = {"searched": res, "seconds": time.time() - t}
        print(tag, "searched", res["accuracy"], res["latency_ms"]["total"], res["splitnets"], flush=True)
        cfg, hw, space, ds = S.prepare(config(name, args.arg))
        epochs = cfg.evolve.epochs + cfg.retrain.epochs
        t = time.time()
        summary["runs"][tag]["baselines"] = baselines(cfg, hw, space, ds, epochs)
        summary["runs"][tag]["baseline_seconds"] = time.time() - t
        print(tag, "baselines", summary["runs"][tag]["baselines"], flush=True)
        if tag == "V1":
            summary["grad_norms"] = {m: grad_norms(cfg, space, ds, m) for m in ("geometric", "fan_in", "fan_out")}
            print("grad norms", summary["grad_norms"], flush=True)
            hist = {"geometric": json.load(open(os.path.join(args.out, tag, "history.json")))}
            t = time.time()
            fan_in = ml_collections.ConfigDict(cfg.to_dict())
            fan_in.splitnets.init = "fan_in"
            problem = S.problem(fan_in, space, S.CostCache(space, hw), RE.fitness_data(cfg, ds))
            hist["fan_in"] = train_supernet(fan_in, problem, ds, train.data_mesh(), None, "", False, False)[1]
            summary["init_ablation"] = {m: [h for h in hs if h["stage"] == "search"] for m, hs in hist.items()}
            summary["init_ablation_seconds"] = time.time() - t
            print("init ablation", summary["init_ablation"], flush=True)
        with open(os.path.join(args.out, f"summary{args.only or ''}.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
    summary["seconds"] = time.time() - t_all
    summary["load_average"] = os.getloadavg()
    with open(os.path.join(args.out, f"summary{args.only or ''}.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    print("total seconds", summary["seconds"], "load", summary["load_average"])


if __name__ == "__main__":
    main()
