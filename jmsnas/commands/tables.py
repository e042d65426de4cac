"""``jmsnas measure``, ``jmsnas adapt`` and ``jmsnas validate``: per-layer latency tables for devices we do not
have, and how well any table predicts measured networks.

    jmsnas measure --space fbnet_c100 --networks 10 --out nets.json [--remote HOST:PORT] [--seed 0] [--reps 20]
    jmsnas adapt --table BASE --measured nets.json --out target.json [--device NAME] [--library TABLE|DIR|shipped ...]
    jmsnas adapt --fit nets.json --out table.json [--holdout 0.1] [--device NAME]
    jmsnas validate --table TABLE (--measured nets.json | --networks N [--remote HOST:PORT]) [--json OUT]
                    [--plot OUT.png] [--no-record]

``measure`` times N random whole networks of the space here, or on the worker at HOST:PORT (``jmsnas worker
--listen HOST:PORT`` on the target: each network goes there as a ``jax.export`` program, jmsnas.deploy.timer), and
writes them as a measured-networks file (jmsnas/cost/networks.py). ``adapt`` fits the target's table from a base
table and such a file (the model and its choice by leave-one-out: jmsnas/cost/adapt.py; with ``--library``, from
every table of the library as the prior, with a 90% interval and the expected error at this many networks and at
10 more: jmsnas/cost/adapt_prior.py) and writes an ordinary table file; ``adapt --fit`` fits a per-layer table
from many networks measured on the device (jmsnas/cost/layerfit.py, validated on the held-out share). ``validate`` compares a table with measured networks (a file, or N random networks measured now) and
reports % within +-10%, MAPE, median/max error, bias, Spearman and Kendall (jmsnas/cost/accuracy.py), and for a
table with an interval how often the measurement falls inside it (calibration); unless
``--no-record``, the report is stored in the table file (``validation``). A TABLE is a per-layer table file
(jmsnas/cost/layertable.py) or HELP's relative-form file with the device after a colon
(``fbnet_lut_pixel3_raspi4.json:raspi4``). Errors print one ``jmsnas CMD: error: ...`` line and exit with 2,
before anything is written.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jmsnas import safeio
from jmsnas.commands import fail


def add_parser(sub) -> None:
    doc = __doc__.split("\n\n")[0]
    m = sub.add_parser("measure", help="time random whole networks of a space here or on a remote jmsnas worker",
                       description=doc)
    m.add_argument("--space", default="fbnet_c100", help="registered space (jmsnas.spaces; default fbnet_c100)")
    m.add_argument("--networks", type=int, required=True, help="how many random networks")
    m.add_argument("--out", required=True, help="measured-networks file to write (JSON)")
    m.add_argument("--remote", default=None, help="HOST:PORT of a jmsnas worker on the target (jmsnas worker --listen)")
    m.add_argument("--device", default=None, help="name of the device measured (default: here, or HOST:PORT)")
    m.add_argument("--seed", type=int, default=0)
    _timing_flags(m)
    _remote_flags(m)
    a = sub.add_parser("adapt", help="a device's latency table from a base table and a few measured networks",
                       description=doc)
    a.add_argument("--table", default=None, help="base table: table file, or HELP's file:DEVICE")
    a.add_argument("--measured", default=None, help="measured-networks file of the target device")
    a.add_argument("--library", nargs="+", default=None, metavar="TABLE",
                   help="tables of devices already measured (files, directories of them, or 'shipped': the library "
                        "that ships for the space) used as the prior; none may be the target's")
    a.add_argument("--fit", default=None, metavar="NETS",
                   help="instead: fit a per-layer table from the networks measured in NETS (many, e.g. 1000)")
    a.add_argument("--holdout", type=float, default=0.1, help="with --fit: the last share of NETS held out to "
                                                               "validate the table (default 0.1)")
    a.add_argument("--out", required=True, help="target table file to write (JSON)")
    a.add_argument("--device", default=None, help="name of the target device (default: the measured file's)")
    v = sub.add_parser("validate", help="how well a latency table predicts measured networks", description=doc)
    v.add_argument("--table", required=True, help="table file, or HELP's file:DEVICE")
    v.add_argument("--measured", default=None, help="measured-networks file to compare with")
    v.add_argument("--networks", type=int, default=None, help="or: measure N random networks now")
    v.add_argument("--remote", default=None, help="with --networks: HOST:PORT of a jmsnas worker")
    v.add_argument("--seed", type=int, default=1)
    v.add_argument("--json", default=None, help="write the report here")
    v.add_argument("--plot", default=None, help="write a scatter plot (PNG) here")
    v.add_argument("--no-record", action="store_true", help="do not store the report in the table file")
    _timing_flags(v)
    _remote_flags(v)


def _remote_flags(p) -> None:
    """With --remote: the worker's secret (and TLS CA), and how long a reply may take."""
    from jmsnas.deploy.daemon import add_secret_arguments
    add_secret_arguments(p)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="with --remote: seconds the worker may take for a reply (a program's compilation and "
                        "timed calls; default 60)")


def _timing_flags(p) -> None:
    p.add_argument("--reps", type=int, default=20, help="timed calls per network (median kept; default 20)")
    p.add_argument("--batch", type=int, default=1, help="images per call (default 1)")


def _check_out(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ValueError(f"output directory {d!r} does not exist")


def _not_an_input(out, flag: str, inputs) -> None:
    """ValueError (one line) when the output path ``out`` of ``flag`` is one of the (name, path) ``inputs`` the
    command reads: it would overwrite it (a table spec FILE:DEVICE names FILE)."""
    if not out:
        return
    for name, path in inputs:
        for p in {path, str(path).rpartition(":")[0]} if path else ():
            if p and os.path.exists(p) and os.path.exists(out) and os.path.samefile(p, out):
                raise ValueError(f"{flag} {out} is the {name} this command reads; write the output elsewhere")
            if p and os.path.realpath(p) == os.path.realpath(out):
                raise ValueError(f"{flag} {out} is the {name} this command reads; write the output elsewhere")


def _check_counts(args) -> None:
    for name in ("networks", "reps", "batch"):
        v = getattr(args, name, None)
        low = 2 if name == "networks" and args.command == "validate" else 1
        if v is not None and v < low:
            raise ValueError(f"--{name} must be an integer >= {low}, got {v}")


def measure_networks(space, archs, args) -> np.ndarray:
    """Median ms of each network, here or on ``args.remote``."""
    from jmsnas.fbnet import measure
    if args.remote:
        from jmsnas.deploy import timer
        timer.parse_address(args.remote)
        return np.array(timer.time_programs(args.remote, [measure.export_network(space, a, args.batch)
                                                          for a in archs], reps=args.reps,
                                            timeout_s=args.timeout, credentials=args.credentials))
    return measure.measure_networks(space, archs, batch=args.batch, reps=args.reps)


def _random_archs(space, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, len(space.op_names), (n, space.num_layers))


def load_table(spec: str):
    from jmsnas.fbnet.help import table_from_spec
    return table_from_spec(spec)


def run(args) -> int:
    from jmsnas.cost import layertable as LT
    try:
        _check_counts(args)
        if args.command in ("measure", "validate"):
            args.credentials = _remote_credentials(args)
        if args.command == "measure":
            return _measure(args)
        if args.command == "adapt":
            return _adapt(args)
        return _validate(args)
    except (LT.TableError, ValueError) as e:
        return fail(args.command, safeio.clip(e, 600))


def _remote_credentials(args):
    """The credentials of --remote (one line naming a bad flag, before anything is measured)."""
    from jmsnas.deploy.daemon import client_credentials
    if not args.remote and (args.secret_file or args.tls_ca):
        raise ValueError("--secret-file and --tls-ca are for --remote HOST:PORT")
    if not 0 < args.timeout <= 86400:
        raise ValueError(f"--timeout must be 0-86400 seconds, got {args.timeout!r}")
    return client_credentials(args) if args.remote else None


def _measure(args) -> int:
    from jmsnas import spaces
    from jmsnas.cost import networks as NW
    from jmsnas.deploy import timer
    space = spaces.get(args.space)
    if args.remote:
        timer.parse_address(args.remote)
    _check_out(args.out)
    archs = _random_archs(space, args.networks, args.seed)
    ms = measure_networks(space, archs, args)
    device = args.device or (args.remote or "here")
    NW.save(NW.make(archs, ms, space.op_names, space=space.name, device=device,
                    info={"seed": args.seed, "reps": args.reps, "batch": args.batch}), args.out)
    print(f"measured {len(ms)} networks of {space.name} on {device}: {np.min(ms):.3f}-{np.max(ms):.3f} ms "
          f"(median {np.median(ms):.3f}); wrote {args.out}")
    return 0


def _library(specs, space: str):
    from jmsnas.cost import library as LB
    paths = []
    for s in specs:
        paths += LB.shipped_paths(space) if s == "shipped" else [s]
    return LB.load(paths)


def _stages(space_name: str):
    """int[N]: the stage of each layer when the space is registered and has stages, else None."""
    from jmsnas import spaces
    try:
        sp = spaces.get(space_name)
    except ValueError:
        return None
    layers = getattr(sp, "stage_layers", None)
    return None if layers is None else np.repeat(np.arange(len(layers)), layers)


def _adapt(args) -> int:
    from jmsnas.cost import adapt, adapt_prior, layerfit, networks as NW
    from jmsnas.cost import layertable as LT
    if args.fit is not None:
        if args.table or args.measured or args.library:
            raise ValueError("--fit NETS takes no --table, --measured or --library")
        _not_an_input(args.out, "--out", [("--fit file", args.fit)])
        measured = NW.load(args.fit)
        _check_out(args.out)
        out = layerfit.fit(measured, holdout=args.holdout, device=args.device)
        LT.save(out, args.out)
        v, f = out.validation, out.adaptation["fit"]
        held = "no held-out networks (--holdout 0)" if v is None else (
            f"held-out {f['networks_held_out']}: within ±10% {v['within_10pct']:.1f}%  MAPE {v['mape_pct']:.2f}%  "
            f"Spearman {v['spearman']:.3f}")
        print(f"fitted a per-layer table of {out.device} on {f['networks_fitted']} networks; {held}")
        print(f"wrote {args.out}")
        return 0
    if not args.table or not args.measured:
        raise ValueError("give --table BASE and --measured NETS (or --fit NETS)")
    _not_an_input(args.out, "--out", [("--measured file", args.measured), ("base table", args.table)]
                  + [("--library table", t) for t in (args.library or []) if t != "shipped"])
    base, _ = load_table(args.table)
    measured = NW.load(args.measured)
    if len(measured.ms) == 0:
        raise ValueError(f"{args.measured}: no measured networks (give at least 1; 10 recommended)")
    lib = _library(args.library, base.space) if args.library else None
    _check_out(args.out)
    if lib is None:
        out = adapt.adapt(base, measured, device=args.device)
    else:
        out = adapt_prior.adapt_library(base, measured, lib, stages=_stages(base.space), device=args.device)
    LT.save(out, args.out)
    a = out.adaptation
    if lib is None:
        lam = "inf (single factor)" if a["lambda"] is None else f"{a['lambda']:g}"
        loo = "n/a (one network)" if a["loo_mape_pct"] is None else \
            f"{a['loo_mape_pct']:.2f}% (max {a['loo_max_pct']:.2f}%)"
        print(f"adapted {base.device} -> {out.device} from {a['networks']} networks: types {a['grouping']}, "
              f"lambda {lam}; leave-one-out MAPE {loo}")
        print("scales: const x" + f"{a['theta_const']:.4g}; " + "; ".join(f"{k} x{v:.4g}" for k, v in
                                                                        a["theta"].items()))
    else:
        _print_library_adaptation(base, out)
    print(f"wrote {args.out}")
    return 0


def _print_library_adaptation(base, out) -> None:
    from jmsnas.cost import adapt_prior
    a = out.adaptation
    if a["fallback"]:
        print(f"adapted {base.device} -> {out.device} from {a['networks']} networks: FELL BACK to the one-factor "
              f"rescale of the base: the data cannot tell that the library helps ({a['why']})")
    else:
        w = ", ".join(f"{d} x{v:.3g}" for d, v in a["weights"].items() if v > 0)
        print(f"adapted {out.device} from {a['networks']} networks and a library of {len(a['library'])}: "
              f"{w}, + corrections ({len(a['chosen'])} model(s) averaged); {a['why']}")
    if a["dropped"]:
        print(f"left out as outliers: measured network(s) {a['dropped']}")
    iv = a["interval"]
    if iv:
        print(f"90% interval: {adapt_prior.describe_interval(iv)} (z {iv['factor']:.2f}: {iv['factor_from']})")
    e = a["expected"]
    if e:
        at, more = e["at"], e["plus_10"]
        print(f"expected error at {at['networks']} networks (library's learning curves, {e['devices']} devices): "
              f"MAPE {at['mape_pct']:.2f}%, {at['within_10pct']:.1f}% within ±10%; with 10 more "
              f"({more['networks']}): MAPE {more['mape_pct']:.2f}%, {more['within_10pct']:.1f}% within ±10%")


def _validate(args) -> int:
    from jmsnas import spaces
    from jmsnas.cost import accuracy, networks as NW
    from jmsnas.cost import layertable as LT
    if (args.measured is None) == (args.networks is None):
        raise ValueError("give exactly one of --measured FILE or --networks N")
    if args.remote and args.networks is None:
        raise ValueError("--remote needs --networks N (the networks to measure there)")
    for flag, out in (("--json", args.json), ("--plot", args.plot)):
        _not_an_input(out, flag, [("--measured file", args.measured), ("table", args.table)])
    table, record = load_table(args.table)
    for p in (args.json, args.plot):
        if p:
            _check_out(p)
    if args.measured:
        m = NW.load(args.measured)
        archs, ms, where = NW.for_table(m, table), m.ms, f"{args.measured} ({m.device})"
    else:
        space = spaces.get(table.space)
        archs = _random_archs(space, args.networks, args.seed)
        ms = measure_networks(space, archs, args)
        where = f"{len(ms)} random networks measured {'on ' + args.remote if args.remote else 'here'}"
    if len(ms) < 2:
        raise ValueError(f"need at least 2 measured networks to validate, got {len(ms)}")
    pred = LT.predict_ms(table, archs)
    rep = accuracy.report(pred, ms)
    rep["against"] = where
    iv = (table.adaptation or {}).get("interval") if isinstance(table.adaptation, dict) else None
    if iv:
        from jmsnas.cost import adapt_prior
        lo, hi = adapt_prior.interval_ms(table, archs)
        rep["interval_level_pct"] = 100 * iv["level"]
        rep["interval_coverage_pct"] = float(100 * np.mean((np.asarray(ms) >= lo) & (np.asarray(ms) <= hi)))
    print(f"{table.source} against {where}:")
    print(f"  within ±10%: {rep['within_10pct']:.1f}%   MAPE {rep['mape_pct']:.2f}%   median error "
          f"{rep['median_error_pct']:.2f}%   max {rep['max_error_pct']:.2f}%   bias {rep['bias_pct']:+.2f}%")
    print(f"  Spearman {rep['spearman']:.3f}   Kendall {rep['kendall']:.3f}   (n = {rep['n']})")
    if iv:
        print(f"  inside the {rep['interval_level_pct']:.0f}% interval: {rep['interval_coverage_pct']:.1f}% "
              f"(calibrated: close to {rep['interval_level_pct']:.0f}%)")
    if args.json:
        with safeio.atomic_write(args.json) as f:
            extra = {"interval_low_ms": lo.tolist(), "interval_high_ms": hi.tolist()} if iv else {}
            json.dump({**rep, "predicted_ms": pred.tolist(), "measured_ms": list(map(float, ms)), **extra}, f,
                      indent=1)
    if args.plot:
        accuracy.scatter(args.plot, pred, ms, f"{table.device}: {rep['within_10pct']:.0f}% within ±10%, "
                                              f"rho {rep['spearman']:.2f}")
    if record and not args.no_record:
        LT.save(table._replace(validation=rep), record)
        print(f"  recorded in {record}")
    return 0
