"""Auto-Split (paper 001) rerun: ResNet-50's split volumes (Table 10), zoo networks over the paper's bandwidths
(in the spirit of Tables 3-6, 8), and a real jmsnas search result quantized at two accuracy thresholds.

(a) Elements crossing the cuts Table 10 lists (after the residual add, which the paper's optimised graph fuses into
    conv3), and the raw input. (b) Auto-Split's Eyeriss -> TPU pair (Table 1) at 1, 3, 10 and 20 Mbit/s (Table 8),
    an edge memory limit, the five methods' latency and bytes sent; zoo networks have no trained weights, so their
    distortion comes from their shapes and A bounds the relative distortion. (c) A ``jmsnas search`` run
    (--run): float vs uniform 8-bit vs Auto-Split's mixed bits at two thresholds A, accuracy measured (candidates
    are accepted on the validation split, the table shows the test split too).

Run: python experiments/autosplit.py --run /tmp/run [--out experiments/autosplit.md]
where /tmp/run is the workdir of ``python -m jmsnas.cli search --config experiments/configs/default.py``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np

from jmsnas.quant import autosplit as AS, solver
from jmsnas.split import zoo
from jmsnas.split.solvers import cut_bytes

ZOO = ("mobilenet_v2", "resnet18", "resnet50")
BANDWIDTHS = (1.0, 3.0, 10.0, 20.0)
ZOO_MEMORY_MIB = 4.0
ZOO_A = 0.05
METHODS = ("cloud_only", "edge_only_u8", "neurosurgeon", "u8_split", "autosplit")


def table10() -> list:
    net = zoo.get("resnet50")
    names = [l.name for l in net.layers]
    cut = cut_bytes(np.array([float(l.out_elems) for l in net.layers]), float(net.input_elems), tuple(net.edges()))
    paper = {"layer4.0": 100_352, "layer4.1": 100_352, "layer4.2": 100_352}
    lines = ["| paper index | layer | paper volume | ours (elements crossing the cut) | shape | ours - input |",
             "|---|---|---|---|---|---|"]
    for idx, block in zip((46, 49, 52), paper):
        n = cut[names.index(f"{block}.add") + 1]
        lines.append(f"| {idx} | {block}.conv3 (+ add) | {paper[block]:,} | {int(n):,} | (2048, 7, 7) | "
                     f"{int(n - net.input_elems):,} |")
    fc = net.layers[names.index("fc")].out_elems
    lines.append(f"| 53 | fc | 1,000 | {fc:,} | (1, 1000) | {fc - net.input_elems:,} |")
    lines.append(f"| -1 | input image | 150,528 | {net.input_elems:,} | (3, 224, 224) | 0 |")
    return lines


def _cell(s: solver.Solution, p: solver.Problem) -> str:
    over = "" if s.edge_memory_bytes <= p.memory_bytes else " (over M)"
    return f"{s.latency_ms:.1f} ms, {s.sent_bytes:,} B, n={s.split}{over}"


def zoo_table() -> list:
    lines = [f"| network | Mbit/s | {' | '.join(METHODS)} | Auto-Split bits (w/a, edge layers) |",
             "|---" * (len(METHODS) + 3) + "|"]
    topo = AS.topology("autosplit")
    bits = (2, 4, 6, 8, 16)
    for name in ZOO:
        net = zoo.get(name)
        dw, da = AS.shape_distortion(net, bits)
        for bw in BANDWIDTHS:
            p = solver.make_problem(net, AS.topology("autosplit", [bw]), ZOO_MEMORY_MIB * 2**20, bits, dw, da)
            chosen, _, _ = solver.select(solver.candidates(p), lambda s: s.distortion, ZOO_A)
            sols = [solver.cloud_only(p), solver.edge_only_u8(p), solver.neurosurgeon(p), solver.u8_split(p), chosen]
            mix = ", ".join(f"{b}:{chosen.wbits.count(b)}/{chosen.abits.count(b)}" for b in bits
                            if chosen.wbits.count(b) or chosen.abits.count(b)) or "-"
            lines.append(f"| {name} | {bw:g} | " + " | ".join(_cell(s, p) for s in sols) + f" | {mix} |")
    del topo
    return lines


def run_table(run: str) -> list:
    settings = [("autosplit", [1.0], 0.15, (2, 4, 6, 8, 16)), ("autosplit", [1.0], 0.15, (4, 5, 6, 8, 16)),
                ("chain", None, 1.0, (2, 4, 6, 8, 16))]
    lines = ["| topology | M (MiB) | B | method | A checked on | A | split n | latency ms | sent B | edge MiB | "
             "val acc | test acc | test drop |", "|---" * 13 + "|"]
    for topo_name, bw, mib, bits in settings:
        topo = AS.topology(topo_name, bw)
        label = f"{topo_name}" + (f" {bw[0]:g} Mbit/s" if bw else " (Table I links)")
        first = True
        for select_on in ("val", "test"):
            for a in (0.01, 0.05):
                out, _ = AS.autosplit(run, topo, mib * 2**20, a, bits, select_on=select_on)
                for m in METHODS if first else ("autosplit",):
                    j = out["methods"][m]
                    acc = j.get("accuracy")
                    accs = (f"{acc['val']:.4f} | {acc['test']:.4f} | {j['accuracy_drop']['test']:+.4f}" if acc
                            else "does not fit | | ")
                    sel = (select_on, f"{a:g}") if m == "autosplit" else ("", "")
                    lines.append(f"| {label} | {mib:g} | {','.join(map(str, bits))} | {m} | {sel[0]} | {sel[1]} | "
                                 f"{j['split']} | {j['latency_ms']['total']:.4f} | {j['sent_bytes']:,} | "
                                 f"{j['edge_memory_bytes'] / 2**20:.4f} | {accs} |")
                    if m == "autosplit" and j["split"]:
                        bits_used = [(b["weight"], b["activation"]) for b in j["bits"]]
                        w = {b: sum(x[0] == b for x in bits_used) for b in bits}
                        ab = {b: sum(x[1] == b for x in bits_used) for b in bits}
                        notes.append(f"{label}, B={','.join(map(str, bits))}, A={a:g} on {select_on}: weights "
                                     + ", ".join(f"{k} bits x{v}" for k, v in w.items() if v) + "; activations "
                                     + ", ".join(f"{k} bits x{v}" for k, v in ab.items() if v))
                first = False
        fa = out["float_accuracy"]
    lines.append("")
    lines.append(f"Float accuracy of the folded network: val {fa['val']:.4f}, test {fa['test']:.4f} "
                 f"(the search's result.json: test {out['search_result_test_accuracy']:.4f}). Edge-layer bit "
                 "widths of the Auto-Split rows that split:")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return lines


notes: list = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="workdir of a jmsnas search run (default config)")
    ap.add_argument("--out", default=None, help="write the markdown tables here (default: print)")
    args = ap.parse_args()
    t = time.time()
    load = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    parts = ["### (a) ResNet-50 split volumes (Table 10)", "", *table10(), "",
             f"### (b) Zoo networks, Eyeriss -> TPU, M = {ZOO_MEMORY_MIB:g} MiB, A = {ZOO_A:g} (relative distortion)",
             "", *zoo_table(), "", f"### (c) The search run {args.run}", "", *run_table(args.run), "",
             f"(code {commit}; {time.time() - t:.0f} s wall, load average {load[0]:.1f} at the start)"]
    text = "\n".join(parts)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
