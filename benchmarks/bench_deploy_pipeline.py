"""Predicted (eq. (1)/(2)) vs measured end-to-end latency of the deployed pipeline, chain and mesh, per bandwidth.

    python benchmarks/bench_deploy_pipeline.py --runs /tmp/i19_chain /tmp/i19_mesh --scales 1 0.1 0.03 0.01

Each RUN is a finished ``jmsnas search`` workdir (exported first when RUN/export is missing). For every bandwidth
scale the pipeline is started afresh (one process per device, links paced to scale x Table I), ``--images`` real
test images go through one at a time (latency phase) and then pipelined (stream phase). The prediction uses the
same settings: the links' bytes / (scale x bandwidth) + latency and every device's compute time calibrated in
isolation on this machine (``--compute-scale host``). Prints one markdown row per (run, scale) with the load
average, and writes the per-term analyses as JSON (``--out``) and one plot per run (RUN/deploy/bench.png).

The honest mode, ``--predict-table TABLE`` (a ``jmsnas profile`` table of the run's space measured on this
machine): the compute terms come from the table through the cost model (``predict.table_prediction``) and the
parts run at host speed, nothing calibrated or slowed; then a row also gives every device's predicted / measured
compute (ms), the latency model's own error. A table with deployed terms (``jmsnas profile`` without
``--no-deployed``) charges every part its call cost and every link its hand-off, as the search does.

    jmsnas profile --space default --out TABLE --dw-impl xla
    python benchmarks/bench_deploy_pipeline.py --runs RUN --scales 0.05 0.02 0.01 --predict-table TABLE

``--reps`` rounds: each round runs every scale, and every mode at each, once in turn (interleaved, so a change of
the machine's state over the benchmark falls on every scale and mode alike, not on the scale that runs last).

Authentication and TLS (``--auth on off tls --reps 3``): every setting runs once per mode in turn; ``on`` is the default (the
local processes prove a shared secret on every data link), ``off`` none, ``tls`` the secret and TLS on every data
link (a certificate for 127.0.0.1 made with ``openssl``). A last table gives per (run, scale, mode) the medians over
the reps of the measured latency and stream throughput, and their ratio to ``off``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jmsnas.deploy import auth, reference, report  # noqa: E402
from jmsnas.deploy.export import export_run  # noqa: E402
from jmsnas.deploy.analysis import analyze  # noqa: E402
from jmsnas.deploy.pipeline import run_pipeline  # noqa: E402
from jmsnas.deploy.predict import table_prediction  # noqa: E402
from jmsnas.deploy.runtime import load_manifest  # noqa: E402


def _worst_term(a: dict) -> str:
    """The term whose measured value is furthest above (or below) its prediction, in ms."""
    p, m = a["predicted"], a["measured"]
    diffs = {k: m["per_device"][k] - v for k, v in p["per_device"].items()}
    diffs.update({k: m["per_link"][k] - v for k, v in p["per_link"].items()})
    diffs.update({k: m["ends"][k] - v for k, v in p.get("ends", {}).items() if k in m.get("ends", {})})
    diffs["hand-offs"] = report.unexplained_ms(a)
    k = max(diffs, key=lambda x: abs(diffs[x]))
    return f"{k} {diffs[k]:+.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.1, 0.03, 0.01])
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--out", default="/tmp/bench_deploy_pipeline.json")
    ap.add_argument("--predict-table", default=None, help="honest mode: compute predicted by this table")
    ap.add_argument("--auth", nargs="+", default=["on"], choices=("on", "off", "tls"),
                    help="on: the local processes' shared secret (default); off: none; tls: secret + TLS")
    ap.add_argument("--reps", type=int, default=1, help="rounds: each runs every (scale, auth) setting once, in turn")
    args = ap.parse_args(argv)
    modes = {m: _credentials(m) for m in args.auth}
    summary = {}
    rows, everything = [], []
    print("| topology | bandwidth | predicted T (ms) | measured T, median [p10, p90] (ms) | error | eq. of measured "
          "terms (ms) | hand-offs (ms) | largest term miss (ms) | throughput pred / meas (img/s) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        export_dir = os.path.join(run, "export")
        if not os.path.isfile(os.path.join(export_dir, "manifest.json")):
            export_run(run)
        manifest = load_manifest(export_dir)
        images, _ = reference.test_images(run, args.images)
        analyses = []
        table, handoff, waits = table_prediction(run, args.predict_table, one_host=True) if args.predict_table \
            else (None, None, None)
        for _, s, mode in [(r, s, m) for r in range(args.reps) for s in args.scales for m in modes]:
            raw = run_pipeline(export_dir, images, bandwidth_scale=s, phase="both", timeout_s=60.0,
                               predicted_compute_ms=table, credentials=modes[mode])
            a = analyze(manifest, raw, handoff, waits)
            a["load_average"] = os.getloadavg()
            a["run"], a["auth"] = run, mode
            analyses.append(a)
            p, m = a["predicted"], a["measured"]
            summary.setdefault((manifest["topology"]["name"], s, mode), []).append(
                (m["total"], m["throughput_per_s"], a["load_average"][0]))
            label = f"x{s:g}" + (f" ({mode})" if len(modes) > 1 or mode != "on" else "")
            print(f"| {manifest['topology']['name']} | {label} | {p['total']:.2f} | {m['total']:.2f} "
                  f"[{m['total_p10']:.2f}, {m['total_p90']:.2f}] | {a['error_pct']:+.1f}% | {m['eq_of_measured']:.2f} "
                  f"| {m['overhead_ms']:.2f} | {_worst_term(a)} | {p['throughput_per_s']:.1f} / "
                  f"{m['throughput_per_s']:.1f} | {a['load_average'][0]:.1f} |", flush=True)
            if table is not None:
                print("|  | per device, predicted / measured compute (ms): " + ", ".join(
                    f"{d} {p['per_device'][d]:.3f} / {m['per_device'][d]:.3f}" for d in manifest["order"]) + " |",
                      flush=True)
        os.makedirs(os.path.join(run, "deploy"), exist_ok=True)
        report.plot(analyses, manifest, os.path.join(run, "deploy", "bench.png"))
        print(report.format_table(analyses, manifest), file=sys.stderr)
        everything += analyses
    with open(args.out, "w") as f:
        json.dump(everything, f, indent=2)
    if len(modes) > 1 or args.reps > 1:
        _summary(summary)
    return 0


def _credentials(mode: str):
    """The credentials ``run_pipeline`` gives the local processes in ``mode``."""
    if mode == "on":
        return None  # the pipeline's own fresh secret
    if mode == "off":
        return auth.NONE
    import tempfile
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "deploy"))
    from certs import make_tls  # openssl: a CA and a certificate for 127.0.0.1
    tls = make_tls(tempfile.mkdtemp(prefix="bench_tls_"))
    return auth.Credentials(auth.generated().secret, tls["cert"], tls["key"], tls["ca"])


def _summary(summary: dict) -> None:
    """Medians over the reps of every (topology, scale, mode), and their ratio to mode off."""
    import statistics
    print("\n| topology | bandwidth | auth | reps | measured T, median (ms) | T / T(off) | stream throughput, median "
          "(img/s) | / off | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (topo, s, mode), rows in summary.items():
        t, thr = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        off = summary.get((topo, s, "off"))
        t0 = statistics.median(r[0] for r in off) if off else float("nan")
        thr0 = statistics.median(r[1] for r in off) if off else float("nan")
        print(f"| {topo} | x{s:g} | {mode} | {len(rows)} | {t:.2f} | {t / t0:.3f} | {thr:.1f} | {thr / thr0:.3f} | "
              f"{statistics.median(r[2] for r in rows):.1f} |")


if __name__ == "__main__":
    sys.exit(main())
