"""The library calls behind ``jmsnas modularize / load / finetune``: each validates its inputs before it computes
or writes anything and returns a JSON-ready report (times in ms unless the key says _s)."""
from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np

from jmsnas import safeio
from jmsnas.modular import blocks as B
from jmsnas.modular import loadmodel as L
from jmsnas.modular import partition as P
from jmsnas.modular import store
from jmsnas.modular.blocks import ModularError


def load_network(model: str, config=None, seed: int = 0) -> B.Network:
    """A zoo network by name (``blocks.from_zoo``), a jmsnas run directory (``blocks.from_run``) or a model
    reference pkg.module:factory (your own model, ``jmsnas.modular.traced.from_traced``)."""
    from jmsnas.split import zoo
    from jmsnas.traced.ref import is_reference
    if model in zoo.NAMES:
        return B.from_zoo(model, seed)
    if os.path.isdir(model):
        return B.from_run(model, config)
    if is_reference(model):
        from jmsnas.modular.traced import from_traced
        return from_traced(model)
    raise ModularError(f"--model {model!r} is neither a zoo network {list(zoo.NAMES)}, a run directory nor a model "
                       "reference pkg.module:factory")


def _read_model(path: str) -> L.LoadModel:
    try:
        return L.LoadModel.from_json(safeio.read_json(path, "load model file", max_bytes=16 * 2**20))
    except (OSError, ValueError) as e:
        if isinstance(e, ModularError):
            raise
        raise ModularError(f"load model file {path!r} is unreadable: {e}") from None


def modularize(model: str, k, out: str, *, strategy: str = "exact", load_model: str | None = None,
               save_load_model: str | None = None, threads: int | None = None, config=None, seed: int = 0,
               inference_time: bool = False, k_max: int = 8, say: Callable[[str], None] = lambda m: None) -> dict:
    """Split ``model`` (zoo name or run directory) into ``k`` children (or "auto") written to ``out``."""
    if strategy not in P.STRATEGIES:
        raise ModularError(f"strategy must be one of {list(P.STRATEGIES)}, got {strategy!r}")
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ModularError(f"number of children must be an integer >= 1 or 'auto', got {k!r}")
    store._check_out(out)
    lm = _read_model(load_model) if load_model else None
    net = load_network(model, config, seed)
    n = len(net.blocks)
    if k != "auto" and k > n:
        raise ModularError(f"{k} children need at least {k} blocks; {net.name} has {n}")
    threads = (os.cpu_count() or 1) if threads is None else threads
    say(f"{net.name}: {n} blocks, {sum(B.block_bytes(b) for b in net.blocks) / 1e6:.2f} MB of parameters")
    if lm is None:
        say("measuring the loading-time model (cold reads) ...")
        lm = L.fit(L.measure(directory=os.path.dirname(os.path.abspath(out))))
        if save_load_model:
            try:
                with safeio.write_errors(f"--save-load-model {save_load_model!r}"), \
                        safeio.atomic_write(save_load_model, encoding="utf-8") as f:
                    json.dump(lm.to_json(), f, indent=1)
            except ValueError as e:
                raise ModularError(str(e)) from None
    say(f"load model: {lm.overhead_ms:.2f} ms per child + {lm.per_array_ms:.3f} ms per array + "
        f"{lm.ms_per_mb:.2f} ms per MB (rmse {lm.rmse_ms:.2f} ms)")
    costs = L.block_ms(lm, net.blocks)
    key = jax.random.key(seed)
    auto_table = None
    if k == "auto":
        k, cuts, auto_table = P.choose_k(strategy, costs, lm.overhead_ms, threads, k_max, key)
    opt_cuts = P.exact(costs, k)
    opt = P.max_child(costs, opt_cuts)
    agent = None
    if strategy == "qlearning":
        say(f"Q-learning split into {k} children ...")
        r = P.qlearning(key, costs, k, reference_ms=opt)
        cuts, agent = r.cuts, {"episodes": r.episodes, "episodes_to_within_10pct": r.episodes_to_10pct,
                               "seconds": r.seconds}
    elif auto_table is None:
        cuts = P.split(strategy, costs, k, key)
    infer = L.inference_ms(net).tolist() if inference_time else None
    child = lm.overhead_ms + P.child_costs(costs, cuts)  # predicted load time of each child (ms)
    report = {
        "network": net.name, "blocks": n, "children": k, "strategy": strategy, "cuts": cuts,
        "threads": threads,
        "predicted_ms": {"children": child.tolist(), "max_child": float(child.max()),
                         "monolith": float(lm.overhead_ms + costs.sum()),
                         "parallel_load": L.makespan_ms(child, min(threads, k)),
                         "exact_max_child": float(lm.overhead_ms + opt),
                         "equal_layers_max_child": float(lm.overhead_ms + P.max_child(costs, P.equal(n, k)))},
        "load_model": {kk: v for kk, v in lm.to_json().items() if kk != "samples"},
        "block_load_ms": costs.tolist(),
    }
    if auto_table is not None:
        report["auto_predicted_ms"] = {str(kk): v for kk, v in auto_table.items()}
    if agent is not None:
        report["agent"] = agent
    if infer is not None:
        report["block_inference_ms"] = infer
    extra = {"report": report, "load_model_full": lm.to_json()}
    if os.path.isdir(model):
        extra["run_config"] = B.run_config(model, config).to_dict()
    say(f"writing {k} children to {out} ...")
    try:
        with safeio.write_errors(f"the children to {out!r}"):
            store.write(net, cuts, out, extra=json.loads(json.dumps(extra, default=list)),
                        progress=lambda i, tot: say(f"  child {i}/{tot} written"))
    except ValueError as e:
        raise ModularError(str(e)) from None
    report["out"] = out
    return report


def format_modularize(r: dict) -> str:
    p = r["predicted_ms"]
    lines = [f"{r['network']}: {r['blocks']} blocks -> {r['children']} children ({r['strategy']}), cuts {r['cuts']}",
             f"predicted load (ms): monolith {p['monolith']:.1f}, heaviest child {p['max_child']:.1f} "
             f"(exact optimum {p['exact_max_child']:.1f}, equal layers {p['equal_layers_max_child']:.1f}), "
             f"in parallel on {min(r['threads'], r['children'])} threads {p['parallel_load']:.1f}"]
    for i, ms in enumerate(p["children"]):
        lines.append(f"  child {i}: blocks {r['cuts'][i]}..{r['cuts'][i + 1] - 1}, predicted {ms:.1f} ms")
    if "agent" in r:
        a = r["agent"]
        lines.append(f"Q-learning: {a['episodes']} episodes in {a['seconds']:.1f} s; within 10% of the exact optimum "
                     f"after {a['episodes_to_within_10pct']} episodes")
    lines.append(f"wrote {r['out']}")
    return "\n".join(lines)


def load(directory: str, *, parallel: int | None = None, infer: bool = False, batch: int = 1, cold: bool = False,
         seed: int = 0, say: Callable[[str], None] = lambda m: None) -> dict:
    """Load the children of ``directory`` (optionally cold, optionally inferring while loading); a report."""
    m = store.read_manifest(directory)
    if cold:
        L.drop_cache(directory)
    x = None
    if infer:
        x = np.random.default_rng(seed).standard_normal((batch,) + tuple(m["input_shape"])).astype(np.float32)
        # compile the children's programs first: shapes are known from the manifest, weights are not needed
        h = x
        for c in m["children"]:
            h = store.run_child(m, c, jax.tree_util.tree_map(np.zeros_like, store.template(c["leaves"])), h)
    k = len(m["children"])
    res = store.load(directory, parallel=parallel, x=x,
                     on_event=lambda ev: say(f"  [{ev.t_s * 1e3:8.1f} ms] child {ev.child + 1}/{k} {ev.what}"))
    report = {"directory": directory, "network": m["network"], "children": k,
              "parallel": res.threads, "cold": cold,
              "load_ms": 1e3 * res.load_s, "child_loaded_ms": [1e3 * t for t in res.child_loaded_s],
              "child_restore_ms": [1e3 * t for t in res.child_restore_s]}
    if infer:
        report.update(first_prediction_ms=1e3 * res.first_prediction_s, output_shape=list(res.output.shape),
                      prediction=np.argmax(res.output.reshape(res.output.shape[0], -1), -1).tolist())
    return report


def format_load(r: dict) -> str:
    s = (f"loaded {r['children']} children of {r['network']} with {r['parallel']} threads"
         f"{' (cold)' if r['cold'] else ''} in {r['load_ms']:.1f} ms")
    if "first_prediction_ms" in r:
        s += f"; first prediction after {r['first_prediction_ms']:.1f} ms (classes {r['prediction']})"
    return s


def finetune(directory: str, *, steps: int = 20, lr: float = 1e-3, batch: int = 64, seed: int = 0) -> dict:
    """Fine-tune the last child of a modularized jmsnas run on its dataset's validation split (data the run did not
    train on; the accuracies reported are on that data)."""
    from jmsnas import data
    from jmsnas.modular.finetune import finetune as ft
    m = store.read_manifest(directory)
    if "run_config" not in m:
        raise ModularError(f"{directory!r} holds {m['network']}, not a jmsnas run: fine-tuning needs the run's "
                           "labelled dataset")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ModularError(f"--steps must be an integer >= 1, got {steps!r}")
    if not (lr > 0 and np.isfinite(lr)):
        raise ModularError(f"--lr must be a positive number, got {lr!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ModularError(f"--batch must be an integer >= 1, got {batch!r}")
    rc = m["run_config"]
    if not isinstance(rc, dict) or not all(k in rc for k in ("dataset", "val_fraction", "seed")):
        raise ModularError(f"{directory!r}: its manifest's run_config is damaged (expected the run's configuration "
                           "with dataset, val_fraction and seed); modularize the run again")
    ds = data.from_config(rc)
    # "new data": the validation split, which the run never trained on
    try:
        with safeio.write_errors(f"the fine-tuned child into {directory!r}"):
            r = ft(directory, ds.val.images, ds.val.labels, steps=steps, lr=lr, batch=batch, seed=seed)
    except ValueError as e:
        raise ModularError(str(e)) from None
    return {"directory": directory, "steps": steps, "loss_first": r.losses[0], "loss_last": r.losses[-1],
            "accuracy_before": r.accuracy_before, "accuracy_after": r.accuracy_after, "child_dir": r.directory}
