"""SplitNets Table 4 (single-sensor ImageNet system), rerun: All-on-sensor, All-on-aggregator and Neurosurgeon.

Setting (paper 000, section 4.1 and Fig. 6): on-sensor NPU 125 GOP/s with 2 MB memory, aggregator NPU 1.25 TOP/s,
each of four sensors gets 25% of the 1.2 Gbit/s bus (37.5 MB/s), weights and activations in 8 bits, the raw
3x224x224 image sent as 8-bit pixels. Networks from ``jmsnas.split.zoo``, latencies from the roofline presets
``splitnets_sensor`` / ``splitnets_aggregator``, peak memory from ``jmsnas.cost.memory`` (weights plus the DAG's
activation working set). Prints a markdown report with the paper's numbers next to ours.

Run: python experiments/splitnets_table4.py [--out experiments/splitnets_table4.md]
"""
from __future__ import annotations

import argparse

from jmsnas.split import compare, solvers, zoo
from jmsnas.topology import presets

BACKBONES = {"MobileNet-v2": "mobilenet_v2", "MNASNet-1.0": "mnasnet1_0", "EfficientNet-B0": "efficientnet_b0",
             "ResNet-152": "resnet152"}
SENSOR_LIMIT = 2e6  # "Mem_sen = 2 MB"; the paper's MB are decimal (5.90 MB for MobileNet-v2's 5.91e6 bytes)

# Table 4 of paper 000: (sen params, sen OPs, sen peak, sen ms, comm size, comm ms, agg params, agg OPs, agg ms,
# overall ms); "-" where the paper prints 0 for an empty part.
PAPER = {
    ("All-on-sensor", "MobileNet-v2"): ("3.51M", "301M", "5.90MB", 2.46, "-", 0, "-", "-", 0, 2.46),
    ("All-on-sensor", "MNASNet-1.0"): ("4.38M", "314M", "5.59MB", 2.52, "-", 0, "-", "-", 0, 2.52),
    ("All-on-sensor", "EfficientNet-B0"): ("5.30M", "386M", "7.70MB", 3.09, "-", 0, "-", "-", 0, 3.09),
    ("All-on-sensor", "ResNet-152"): ("60.2M", "11.5G", "120MB", 92.1, "-", 0, "-", "-", 0, 92.1),
    ("All-on-aggregator", "MobileNet-v2"): ("-", "-", "-", 0, "3·224²", 4.01, "3.51M", "301M", 0.24, 4.25),
    ("All-on-aggregator", "MNASNet-1.0"): ("-", "-", "-", 0, "3·224²", 4.01, "4.38M", "314M", 0.25, 4.26),
    ("All-on-aggregator", "EfficientNet-B0"): ("-", "-", "-", 0, "3·224²", 4.01, "5.3M", "386M", 0.31, 4.32),
    ("All-on-aggregator", "ResNet-152"): ("-", "-", "-", 0, "3·224²", 4.01, "60.2M", "11.5G", 9.21, 13.2),
    ("Neurosurgeon", "MobileNet-v2"): ("-", "-", "-", 0, "3·224²", 4.01, "3.51M", "301M", 0.24, 4.25),
    ("Neurosurgeon", "MNASNet-1.0"): ("82.0K", "103M", "1.29MB", 0.83, "80·14²", 0.84, "4.30M", "212M", 0.17, 1.82),
    ("Neurosurgeon", "EfficientNet-B0"): ("-", "-", "-", 0, "3·224²", 4.01, "5.3M", "386M", 0.31, 4.32),
    ("Neurosurgeon", "ResNet-152"): ("-", "-", "-", 0, "3·224²", 4.01, "60.2M", "11.5G", 9.21, 13.2),
}


def paper_peak_rule(net):
    """Peak bytes as Table 4's figures imply: 8-bit weights + twice the largest 8-bit activation tensor."""
    return lambda layers: float(sum(net.layers[i].params for i in layers)
                                + 2 * max(net.layers[i].out_elems for i in layers))


def _count(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return "-" if x == 0 else f"{x:.0f}"


def _tensor(shape) -> str:
    return f"{shape[2]}·{shape[0]}²" if len(shape) == 3 and shape[0] == shape[1] else "·".join(map(str, shape))


def crossing(net, r) -> str:
    """The tensors sent sensor -> aggregator, as C·H² (the input is 3·224²)."""
    on = set(int(i) for i in (r.assignment == 0).nonzero()[0])
    sent = sorted({p for i, l in enumerate(net.layers) if i not in on for p in (l.inputs or (-1,))
                   if p == -1 or p in on})
    return " + ".join(_tensor(net.input_shape if p < 0 else net.layers[p].out_shape) for p in sent) or "-"


def row(net, r, peak_rule) -> tuple:
    on = r.assignment == 0
    params = [sum(l.params for l, s in zip(net.layers, on) if s == flag) for flag in (True, False)]
    macs = [sum(l.macs for l, s in zip(net.layers, on) if s == flag) for flag in (True, False)]
    pk = r.peak_bytes["sensor"]
    idx = tuple(int(i) for i in on.nonzero()[0])
    rule = peak_rule(idx) if idx else 0.0
    mark = lambda b: "-" if b == 0 else f"{b / 1e6:.2f}MB {'✓' if b <= SENSOR_LIMIT else '✗'}"
    return (_count(params[0]), _count(macs[0]), f"{mark(pk)} / {mark(rule)}", r.per_device_ms["sensor"],
            crossing(net, r), r.per_link_ms["sensor->aggregator"], _count(params[1]), _count(macs[1]),
            r.per_device_ms["aggregator"], r.total_ms)


def fmt(cells) -> str:
    return " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells)


def run() -> tuple:
    """{(method, backbone): SplitResult}, {backbone: (net, setup)}."""
    topo = presets.splitnets_preset()
    results, setups = {}, {}
    for label, name in BACKBONES.items():
        net = zoo.get(name)
        s = compare.make_setup(net, topo, act_bits=8, weight_bits=8)
        setups[label] = (net, s)
        args = (s.compute_ms, s.out_bytes, s.input_bytes, topo)
        kw = dict(edges=s.edges, peak=s.peak, memory_limits={"sensor": SENSOR_LIMIT})
        results[("All-on-sensor", label)] = solvers.edge_only(*args, **kw)
        results[("All-on-aggregator", label)] = solvers.cloud_only(*args, **kw)
        ns = solvers.neurosurgeon(*args, edges=s.edges)
        results[("Neurosurgeon (latency only)", label)] = solvers.path_latency(ns.assignment, *args, **kw)
        results[("Neurosurgeon (≤ 2 MB, our peak)", label)] = solvers.neurosurgeon(*args, **kw)
        pr = solvers.neurosurgeon(*args, edges=s.edges, peak=paper_peak_rule(net),
                                  memory_limits={"sensor": SENSOR_LIMIT})
        results[("Neurosurgeon (≤ 2 MB, paper's peak rule)", label)] = solvers.path_latency(pr.assignment, *args, **kw)
    return results, setups


HEADER = ("| Method | Backbone | source | sen. #params | sen. #OPs | sen. peak (ours / paper rule) | sen. ms "
          "| comm. size | comm. ms | agg. #params | agg. #OPs | agg. ms | overall ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def table(results, setups) -> str:
    lines = [HEADER]
    for (method, label), r in results.items():
        net = setups[label][0]
        lines.append(f"| {method} | {label} | jmsnas | {fmt(row(net, r, paper_peak_rule(net)))} |")
        paper_key = ("Neurosurgeon" if method.startswith("Neurosurgeon (≤ 2 MB, paper") else method, label)
        if paper_key in PAPER:
            lines.append(f"| {paper_key[0]} | {label} | paper | {fmt(PAPER[paper_key])} |")
    return "\n".join(lines)


def _sensor_layers(r) -> tuple:
    return tuple(int(i) for i in (r.assignment == 0).nonzero()[0])


def _facts(results, setups) -> dict:
    """The figures the notes quote, computed (not typed in)."""
    f = {}
    sen = [(results[("All-on-sensor", b)].total_ms, PAPER[("All-on-sensor", b)][3]) for b in BACKBONES]
    agg = [(results[("All-on-aggregator", b)].per_device_ms["aggregator"], PAPER[("All-on-aggregator", b)][8])
           for b in BACKBONES]
    f["dev"] = 100 * max(abs(a / p - 1) for a, p in sen + agg)
    f["rule_all"] = {b: paper_peak_rule(n)(range(len(n.layers))) / 1e6 for b, (n, _) in setups.items()}
    f["free"] = {b: results[("Neurosurgeon (latency only)", b)] for b in BACKBONES}
    f["ruled"] = {b: results[("Neurosurgeon (≤ 2 MB, paper's peak rule)", b)] for b in BACKBONES}
    f["same"] = {b: crossing(setups[b][0], f["ruled"][b]) == PAPER[("Neurosurgeon", b)][4] for b in BACKBONES}
    f["largest"] = {}
    f["min_sent"] = {}
    for b, (net, s) in setups.items():
        big = max(net.layers, key=lambda l: l.out_elems)
        f["largest"][b] = big.out_shape
        rule = paper_peak_rule(net)
        fits = [k for k in range(1, len(net.layers) + 1) if rule(range(k)) <= SENSOR_LIMIT]
        cut = solvers.cut_bytes(s.out_bytes, s.input_bytes, s.edges)
        f["min_sent"][b] = min((cut[k] for k in fits if k < len(net.layers)), default=float("inf"))
    return f


def notes(results, setups) -> str:
    f = _facts(results, setups)
    mb, nets = lambda b: setups[b][0], list(BACKBONES)
    mnas = f["ruled"]["MNASNet-1.0"]
    mnas_on = _sensor_layers(mnas)
    free_fit = all(f["free"][b].peak_bytes["sensor"] <= SENSOR_LIMIT for b in ("MobileNet-v2", "EfficientNet-B0"))
    agree = ", ".join(f"{b} {'as' if f['same'][b] else 'UNLIKE'} the paper ({crossing(mb(b), f['ruled'][b])})"
                      for b in nets)
    lines = [
        "## Why our numbers differ from the paper's",
        "",
        "* **Compute latency.** The roofline presets run at the NPUs' stated peaks with 1 OP = 1 multiply-add "
        "(the paper's convention: MobileNet-v2's 301 M OPs in 2.46 ms is 125 G multiply-adds/s). All-on-sensor "
        f"and aggregator compute times agree with Table 4 within {f['dev']:.1f}%; the residue comes from MAC "
        "counts (our zoo follows torchvision) and the roofline's memory-bandwidth term on small layers.",
        "* **Peak memory.** Ours is the 8-bit weights of the sensor's layers plus the largest set of activations "
        "alive at once on the DAG (inputs, outputs and skip tensors). Table 4's figures follow a simpler rule, "
        "8-bit weights plus twice the largest activation tensor (column 'paper rule'): "
        + ", ".join(f"{b} {f['rule_all'][b]:.2f} MB (paper {PAPER[('All-on-sensor', b)][2]})" for b in nets)
        + f", and MNASNet-1.0's Neurosurgeon part {paper_peak_rule(mb('MNASNet-1.0'))(mnas_on) / 1e6:.2f} MB "
        "(paper 1.29MB). ResNet-152's 120 MB is the exception: it is about twice its 8-bit weights "
        "(60.2 M parameters) and we cannot reproduce it. Under either rule every network is far over 2 MB when "
        "run entirely on the sensor, as the paper says.",
        "* **Neurosurgeon.** An exhaustive single-split search on latency alone does not fall back to "
        "All-on-aggregator for MobileNet-v2 "
        f"({f['free']['MobileNet-v2'].total_ms:.2f} ms, sending {crossing(mb('MobileNet-v2'), f['free']['MobileNet-v2'])}) "
        f"or EfficientNet-B0 ({f['free']['EfficientNet-B0'].total_ms:.2f} ms, sending "
        f"{crossing(mb('EfficientNet-B0'), f['free']['EfficientNet-B0'])}), and those splits "
        f"{'fit' if free_fit else 'do not fit'} in 2 MB under our peak accounting. Restricted to sensor parts "
        f"within 2 MB under the paper's peak rule, our Neurosurgeon splits {agree}. Under that rule "
        + "; ".join(f"{b}'s largest tensor is {_tensor(f['largest'][b])} and the splits that fit send at least "
                    f"{f['min_sent'][b]:,.0f} bytes" for b in ("MobileNet-v2", "EfficientNet-B0"))
        + f" (the raw image is {setups['MobileNet-v2'][1].input_bytes:,.0f} bytes). So the paper's Neurosurgeon "
        "rows follow from its memory rule, not from latency.",
        "* **MNASNet-1.0's Neurosurgeon communication.** "
        f"{'Same split as the paper' if f['same']['MNASNet-1.0'] else 'A different split from the paper'}: "
        f"{_count(sum(mb('MNASNet-1.0').layers[i].params for i in mnas_on))} parameters and "
        f"{_count(sum(mb('MNASNet-1.0').layers[i].macs for i in mnas_on))} OPs on the sensor, "
        f"{mnas.per_device_ms['sensor']:.2f} ms. It sends {mnas.per_link_bytes['sensor->aggregator']:,.0f} bytes, "
        f"{mnas.per_link_ms['sensor->aggregator']:.2f} ms at 37.5 MB/s; the paper lists 0.84 ms, twice that, "
        "while its other rows use one byte per value (3·224² in 4.01 ms, Head Distill's 12·29² in 0.27 ms). "
        f"Hence our overall {mnas.total_ms:.2f} ms against the paper's 1.82 ms.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown report to this file")
    args = ap.parse_args(argv)
    results, setups = run()
    text = ("# SplitNets Table 4, rerun with jmsnas\n\n"
            "Single-sensor ImageNet system: sensor 125 GOP/s and 2 MB, aggregator 1.25 TOP/s, 37.5 MB/s per sensor "
            "(300 Mbit/s), 8-bit weights and activations, 8-bit raw image. Peak memory is flagged against 2 MB "
            "(✓ fits, ✗ over). 'paper rule' = 8-bit weights + 2 x the largest activation tensor. "
            "Generated by `experiments/splitnets_table4.py`.\n\n" + table(results, setups) + "\n" + notes(results, setups))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
