"""Does a table measured here predict the measured end-to-end latency of random sub-networks?

    python benchmarks/predict_vs_measured.py [--space default] [--archs 50] [--reps 100] [--quantile 0.5]
                                             [--seed 2024] [--method in-network|standalone] [--separate]
                                             [--dw-impl auto] [--out table.yaml]
    python benchmarks/predict_vs_measured.py --space experiments/configs/cifar_chain.py --out cifar.yaml

Profiles a search space (``--space``, as ``jmsnas profile --space`` takes it; default: the main job's, chain preset,
8x8x1 input, 10 classes, widths 24/32/48/64, strides 1/2/1/2, whose networks take about 0.4 ms on a 2-core CPU,
about twice their own spread; the CIFAR-sized ``experiments/configs/cifar_chain.py``, 32x32x3 and 20 slots,
takes several ms per network, where the model rather than the timer is measured) on the current JAX backend
(``jmsnas.cost.profile``), samples ``--archs`` random valid
sub-networks (numpy seed ``--seed``, none of them a network the profile itself times), measures each end to end
as one jitted call and compares with the table's prediction (``predict_arch_ms``). By default the sub-networks
are timed in the profile's own rounds (``measure_table_and_archs``; the table is computed from the profile's
measurements only), so that both see the same load on a shared machine; ``--separate`` times them afterwards
(``measure_archs_ms``). Prints the fraction within +-10% (the accuracy measure nn-Meter reports), the median
absolute error, the mean error (bias), the measured networks' range (ms), the load average and a markdown table.
The comparison's report (``jmsnas.cost.accuracy.report``, what ``jmsnas validate`` reports: within +-10%, MAPE,
median/max error, bias, Spearman, Kendall) is stored in the table written by ``--out`` (its ``validation``).
Target: >= 90% within +-10%.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jmsnas.topology import presets
from jmsnas.commands.profile import space_from_arg
from jmsnas.cost import accuracy
from jmsnas.cost import profile as P
from jmsnas.space import OP_NAMES, build_space


def default_space():
    return build_space(presets.chain_preset(), image_size=8, in_channels=1, num_classes=10,
                       device_channels=(24, 32, 48, 64), device_strides=(1, 2, 1, 2), stem_channels=16,
                       stem_stride=1, head_channels=128)


def _variants(space, base) -> set:
    """The networks the in-network profile times: its base and every one-slot variant of it."""
    mask = space.mask()
    out = {base}
    for n in range(space.num_layers):
        out |= {base[:n] + (int(i),) + base[n + 1:] for i in np.flatnonzero(mask[n])}
    return out


def _short(ops) -> str:
    return " ".join(OP_NAMES[i].replace("mbconv_", "").replace("identity", "id") for i in ops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--space", default="default", help="default, mesh, a space file or a config (jmsnas profile)")
    ap.add_argument("--dw-impl", default="auto", choices=("auto", "xla", "shifted", "native"))
    ap.add_argument("--archs", type=int, default=50)
    ap.add_argument("--reps", type=int, default=100, help="rounds of the profile and of the measurement")
    ap.add_argument("--method", default="in-network", choices=("in-network", "standalone"))
    ap.add_argument("--calibrate", type=int, default=8, help="calibration networks of the profile (offset; in-network "
                    "also the scale of the op entries)")
    ap.add_argument("--quantile", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=2024, help="seed of the evaluated sub-networks")
    ap.add_argument("--separate", action="store_true",
                    help="measure the sub-networks after the profile instead of in the profile's rounds")
    ap.add_argument("--out", default=None, help="also write the measured table here")
    args = ap.parse_args(argv)

    space = default_space() if args.space == "default" else space_from_arg(args.space)
    kw = dict(reps=args.reps, quantile=args.quantile, dw_impl=args.dw_impl)
    profiled_calib = set(P.sample_archs(space, args.calibrate, [0, 1]))  # timed by the profile (both methods)
    base = tuple([0] * space.num_layers)
    seen = profiled_calib | _variants(space, base) if args.method == "in-network" else profiled_calib
    archs = [a for a in P.sample_archs(space, args.archs + 100, args.seed) if a not in seen][:args.archs]
    t0 = time.time()
    if args.separate:
        table = P.measure_table(space, method=args.method, calibrate=args.calibrate, seed=0, base=base, **kw)
        t_profile = time.time() - t0
        measured = P.measure_archs_ms(space, archs, seed=args.seed, **kw)
    else:
        table, measured = P.measure_table_and_archs(space, archs, method=args.method, calibrate=args.calibrate,
                                                    seed=0, base=base, **kw)
        t_profile = time.time() - t0
    t_measure = time.time() - t0 - t_profile
    meas = np.array([m.median_ms for m in measured])
    pred = np.array([P.predict_arch_ms(table, a) for a in archs])
    err = pred / meas - 1.0
    load = os.getloadavg()
    rep = dict(accuracy.report(pred, meas), against=f"{len(archs)} random sub-networks of {args.space} (seed "
               f"{args.seed}) measured {'after the profile' if args.separate else 'in its rounds'}, load average "
               f"{load[0]:.1f}")
    if args.out:
        P.write_table(table._replace(validation=rep), args.out)

    d = table.device
    print(f"device: {d['backend']} / {d['cpu']} ({d['cpu_count']} cores), jax {d['jax']}")
    when = "after the profile" if args.separate else "in the profile's rounds"
    print(f"profile ({table.settings['method']}): {table.settings['reps']} rounds, quantile "
          f"{table.settings['quantile']}, {t_profile:.0f} s; {len(archs)} sub-networks measured {when}"
          + (f" ({t_measure:.0f} s)" if args.separate else ""))
    print(f"table: call {table.call.median_ms:.4f} ms, per argument array {table.arg_ms * 1e3:.2f} us, "
          f"stem {table.stem.median_ms:.4f} ms, head {table.head.median_ms:.4f} ms, "
          f"network offset {table.network['offset_ms']:+.4f} ms ({table.network['method']}, "
          f"{table.network['networks']} networks measured)")
    print(f"within +-10%: {np.mean(np.abs(err) <= 0.10):.0%} ({np.sum(np.abs(err) <= 0.10)}/{len(err)}), "
          f"median |error| {np.median(np.abs(err)):.1%}, max |error| {np.max(np.abs(err)):.1%}")
    print(f"mean error {np.mean(err):+.1%} (bias), error std {np.std(err):.1%}")
    print(f"measured networks {meas.min():.3f}-{meas.max():.3f} ms (median {np.median(meas):.3f}); load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; report (jmsnas validate's): within +-10% "
          f"{rep['within_10pct']:.0f}%, MAPE {rep['mape_pct']:.1f}%, Spearman {rep['spearman']:.3f}"
          + (f", stored in {args.out}" if args.out else ""))
    print()
    print("| # | ops (slot 0..N-1) | measured ms (IQR) | predicted ms | error |")
    print("|---|---|---|---|---|")
    for k, (a, m, p, e) in enumerate(zip(archs, measured, pred, err)):
        print(f"| {k} | {_short(a)} | {m.median_ms:.4f} ({m.spread_ms:.4f}) | {p:.4f} | {e:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
