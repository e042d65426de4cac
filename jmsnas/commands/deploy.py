"""``jmsnas export``, ``jmsnas pipeline`` and ``jmsnas worker``: deploy a run's per-device parts and run them as a
real pipeline, on this machine or across machines.

    jmsnas export --workdir RUN [--out DIR] [--platforms cpu,cuda] [--batch 1]
    jmsnas export --model pkg.module:factory --topology chain|mesh|FILE --workdir DIR [--method chain_dp|--cuts 2,4,6]
                  [--data FILE.npz|tfds:NAME [--data-dir D]] [--act-bits 32] [--bandwidth MBPS ...]
    jmsnas pipeline --workdir RUN [--images 100] [--bandwidth-scale 1 0.2 0.05] [--compute-scale host]
                    [--phase both] [--timeout 10] [--base-port 0] [--check]
                    [--hosts FILE [--connect-timeout 5] [--secret-file F] [--tls-ca CA]] [--pacing user|network]
    jmsnas worker [--listen HOST:PORT] [--secret-file F] [--tls-cert C --tls-key K --tls-ca CA] [--max-sessions 4]
                  [--handshake-timeout 10]

``export`` writes RUN/export/ (one jax.export program + weights per device and manifest.json; RUN may also be the
directory of ``jmsnas autosplit --write-parts``: the quantized edge part and the packed activations, see
``jmsnas.deploy.autosplit``, whose pipeline streams the test images of the run the parts were cut from; or a
``jmsnas evolve`` run with a ``splitnets`` block: V sensor parts, one view each, on a shared bus into the
aggregator, see ``jmsnas.deploy.splitnets``; or a composed run, whose result.json records every link's split
module and bit width and every layer's weight bits: the parts hold the packed weights, Conv-Reduce/Recover and
packed transmitted tensors, see ``jmsnas.deploy.composed``). ``pipeline``
exports first when RUN/export/manifest.json is missing, then, for every bandwidth scale, starts one process per
device connected over 127.0.0.1 in the topology's shape with every link paced to its (scaled) bandwidth and
latency, streams the run's test images through, prints eq. (1)/(2)'s prediction (a separable run: its search's
cost model, ``separable.cost``) beside the measurement (per device, per link, total, throughput) and writes
RUN/deploy/pipeline.json and pipeline.png. ``--check`` also
compares the outputs with the whole compact network's (max abs difference) and every link's measured payload bytes
with the export's prediction. With ``--model`` (your own JAX
model, docs/your_model.md) ``export`` traces it, splits it with ``--method`` and writes DIR/export/ in the same
format plus DIR/reference/ (the model's own apply, what ``pipeline --check`` compares with) and DIR/traced.json
(``jmsnas.deploy.traced``); ``pipeline --workdir DIR`` then streams the ``--data`` images (else standard normal
ones, without accuracy). ``--hosts FILE`` (YAML/JSON, device -> HOST:PORT) runs every device on the ``jmsnas worker
--listen HOST:PORT`` named for it instead of a local process; ``--pacing network`` paces nothing in user space (the
network, e.g. a ``tc`` shaper, sets the links' rates). Errors (a corrupt part, a manifest that does not match the
parts, a port in use, a device that dies or hangs, a host that cannot be resolved, reached or connected to, a part
exported by an incompatible jax) print one line and exit with 2.
"""
from __future__ import annotations

import json
import os

from jmsnas.runcheck import number_flag, path_flag
from jmsnas.commands import fail

MAX_PORT = 65535


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a run's per-device parts as jax.export programs + weights",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, type=path_flag, help="a finished run (result.json, parts/)")
    p.add_argument("--out", default=None, type=path_flag, help="export directory (default RUN/export)")
    p.add_argument("--platforms", default="cpu", help="comma-separated: cpu, cuda, rocm, tpu (default cpu)")
    p.add_argument("--batch", type=number_flag(int, 1, 4096), default=1, help="images per call of every part (default 1)")
    p.add_argument("--model", default=None, help="a model reference pkg.module:factory: trace, split and export "
                   "your own model into --workdir (docs/your_model.md)")
    p.add_argument("--topology", default=None, help="with --model: a preset (chain, mesh) or a topology file")
    p.add_argument("--method", default="chain_dp", help="with --model: the split method (default chain_dp)")
    p.add_argument("--cuts", default=None, help="with --model: the split's points instead of --method, e.g. 2,4,6 "
                   "(device p of the path runs layers cuts[p-1] .. cuts[p]-1)")
    p.add_argument("--bandwidth", type=float, nargs="+", metavar="MBPS", help="with --model: link bandwidth(s)")
    p.add_argument("--act-bits", type=number_flag(int, 1, 64), default=32, help="with --model: activation bits the split assumes")
    p.add_argument("--data", default=None, help="with --model: evaluation data FILE.npz or tfds:NAME for the pipeline")
    p.add_argument("--data-dir", default=None, help="with --model: tfds data directory")
    q = sub.add_parser("pipeline", help="run the parts as one process per device over throttled TCP links",
                       description=__doc__.split("\n\n")[0])
    q.add_argument("--workdir", required=True, type=path_flag, help="a finished run (exported first when needed)")
    q.add_argument("--export-dir", default=None, type=path_flag, help="default RUN/export")
    q.add_argument("--images", type=number_flag(int, 1, 100000), default=100, help="test images to stream (default 100)")
    q.add_argument("--bandwidth-scale", type=number_flag(float, 0, 1e6, low_open=True), nargs="+", default=[1.0],
                   help="multiply every link's bandwidth; several values: one run each (default 1)")
    q.add_argument("--compute-scale", default="host",
                   help="'host' (this machine's speed), 'profile' (each device slowed to the run's cost-table "
                        "time), a factor S >= 1, or per device 'ue=4,sbs=2'")
    q.add_argument("--phase", default="both", choices=("latency", "stream", "both"),
                   help="latency: one image at a time; stream: pipelined; both (default)")
    q.add_argument("--window", type=number_flag(int, 1, 4096), default=8, help="images in flight in the stream phase (default 8)")
    q.add_argument("--timeout", type=number_flag(float, 0, 86400, low_open=True), default=10.0,
                   help="seconds without progress before a device is declared hung (default 10)")
    q.add_argument("--base-port", type=number_flag(int, 0, MAX_PORT), default=0,
                   help="the first device's data port; the others use the next ones (default 0: free ports)")
    q.add_argument("--check", action="store_true", help="compare the outputs with the whole compact network")
    q.add_argument("--hosts", default=None,
                   help="YAML/JSON file device -> HOST:PORT of a 'jmsnas worker --listen' per device (default: "
                        "local processes on 127.0.0.1)")
    q.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to wait for a worker in --hosts to accept the connection (default 5)")
    q.add_argument("--predict-table", default=None, metavar="TABLE",
                   help="a latency table of this machine (jmsnas profile) predicts every device's compute; the "
                        "parts run at host speed, nothing slowed or calibrated (the latency model's real error)")
    q.add_argument("--pacing", default="user", choices=("user", "network"),
                   help="user: the senders pace every link (default); network: no pacing in user space, the "
                        "network's shaper (tc) sets the links' rates")
    w = sub.add_parser("worker", help="serve pipeline sessions on HOST:PORT (one per machine of a --hosts file)",
                       description="Listen on HOST:PORT; every coordinator connection becomes a session process "
                                   "that receives its part and plays that device (jmsnas/deploy/daemon.py).")
    from jmsnas.deploy import daemon
    daemon.add_arguments(w)
    daemon.add_secret_arguments(q)
    q.add_argument("--json", action="store_true", help="print the analysis as JSON instead of the table")


def parse_compute(text: str):
    """'host' | 'profile' | a float | 'dev=S,dev=S' -> the ``compute`` argument of ``run_pipeline``."""
    from jmsnas.deploy.runtime import DeployError
    if text in ("host", "profile"):
        return text
    try:
        if "=" in text:
            return {k.strip(): float(v) for k, v in (item.split("=", 1) for item in text.split(","))}
        return float(text)
    except ValueError:
        raise DeployError(f"--compute-scale must be 'host', 'profile', a number or 'device=S,...', "
                          f"got {text!r}") from None


def run(args) -> int:
    from jmsnas.data import DatasetError
    from jmsnas.deploy.export import export_run
    from jmsnas.deploy.runtime import DeployError
    from jmsnas.topology import TopologyError
    if args.command == "worker":
        from jmsnas.deploy import daemon
        return daemon.run(args)
    try:
        if args.command == "export":
            platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
            if args.model is not None:
                m, out = _export_traced(args, platforms), os.path.join(args.workdir, "export")
            else:
                export = system(args.workdir)[0] or export_run  # a traced workdir: export_run names what is missing
                m = export(args.workdir, args.out, platforms=platforms, batch=args.batch)
                out = args.out or os.path.join(args.workdir, "export")
            for d in m["order"]:
                part = m["parts"][d]
                print(f"{d:<10} layers {part['layers']}  in {[i['shape'] for i in part['inputs']]} from "
                      f"{[i['from'] for i in part['inputs']]}  out {part['output']['shape']} to {part['to']}")
            print(f"wrote {out} ({', '.join(m['platforms'])})")
            return 0
        return _pipeline(args)
    except (DeployError, DatasetError, TopologyError, ValueError) as e:
        return fail(args.command, e)


def system(workdir: str) -> tuple:
    """(export(workdir, out, platforms=, batch=), images(workdir, n) -> (images, labels or None), whole(workdir) ->
    the reference f(images)) of the parts in ``workdir``, by what wrote them: ``jmsnas export --model`` (your own
    model: no export from the workdir, its evaluation data and its own apply), ``jmsnas autosplit --write-parts``
    (its run's test images, its fake-quantized network), ``jmsnas evolve`` with a ``splitnets`` block (V views per
    image, the sensor and aggregator parts composed in one process), ``jmsnas separable`` (G staged parts,
    ``network.apply`` on the stored params), a composed run (result.json ``compose``: ``composed_apply`` over the
    parts' batches, ``jmsnas.deploy.composed``) or a search run (its compact network)."""
    from jmsnas.deploy import autosplit, composed, export, reference, separable, splitnets, traced
    if traced.is_traced(workdir):
        return None, traced.eval_images, traced.whole_model
    if autosplit.is_autosplit(workdir):
        return autosplit.export_autosplit, autosplit.eval_images, autosplit.fake_quant_reference
    if splitnets.is_splitnets(workdir):
        return splitnets.export_splitnets, splitnets.test_images, splitnets.whole_network
    if separable.is_separable(workdir):
        return separable.export_separable, separable.test_images, separable.whole_network
    if composed.is_composed(workdir):
        return composed.export_composed, reference.test_images, composed.whole_network
    return export.export_run, reference.test_images, reference.whole_network


def _export_traced(args, platforms) -> dict:
    from jmsnas.deploy.runtime import DeployError
    from jmsnas.deploy.traced import export_traced
    if args.topology is None:
        raise DeployError("--model needs --topology (chain, mesh or a topology file)")
    if args.out is not None:
        raise DeployError("--out is for run directories; with --model the export goes to WORKDIR/export")
    cuts = None
    if args.cuts is not None:
        try:
            cuts = [int(c) for c in args.cuts.split(",")]
        except ValueError:
            raise DeployError(f"--cuts must be comma-separated layer indices such as 2,4,6, got {args.cuts!r}") from None
    return export_traced(args.model, args.topology, args.workdir, method=args.method, cuts=cuts, platforms=platforms,
                         batch=args.batch, act_bits=args.act_bits, bandwidths_mbps=args.bandwidth, data=args.data,
                         data_dir=args.data_dir)


def _pipeline(args) -> int:
    import numpy as np

    from jmsnas.deploy import report, separable
    from jmsnas.deploy.analysis import analyze
    from jmsnas.deploy.hosts import read_hosts
    from jmsnas.deploy.pipeline import run_pipeline
    from jmsnas.deploy.runtime import DeployError, load_manifest
    from jmsnas.deploy.daemon import client_credentials
    compute = parse_compute(args.compute_scale)
    creds = client_credentials(args)
    if not args.hosts and (args.secret_file or args.tls_ca):
        raise DeployError("--secret-file and --tls-ca are for --hosts (a local pipeline's processes share a secret "
                          "of their own)")
    hosts = read_hosts(args.hosts) if args.hosts else None
    groups = separable.is_separable(args.workdir)
    predicted, handoff, waits = None, None, None
    if args.predict_table:
        if groups:
            raise DeployError(f"--predict-table {args.predict_table}: a latency table times the JMSNAS search space; "
                              "a separable run is predicted by its own cost model (separable.cost), without it")
        from jmsnas.deploy.composed import is_composed
        if is_composed(args.workdir):
            raise DeployError(f"--predict-table {args.predict_table}: a latency table has no bit dimension and no "
                              "split modules; a composed run's parts are not predicted by it")
        from jmsnas.deploy.predict import table_prediction
        predicted, handoff, waits = table_prediction(args.workdir, args.predict_table, one_host=hosts is None)
    if not args.connect_timeout > 0:
        raise DeployError(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout!r}")
    export_dir = args.export_dir or os.path.join(args.workdir, "export")
    export, images_of, whole_of = system(args.workdir)
    images, labels = images_of(args.workdir, args.images)
    whole = lambda: whole_of(args.workdir)
    for s in args.bandwidth_scale:
        if not s > 0:
            raise DeployError(f"--bandwidth-scale values must be > 0, got {s!r}")
    if not os.path.isfile(os.path.join(export_dir, "manifest.json")):
        if export is None:  # your own model: exported by jmsnas export --model only
            raise DeployError(f"{export_dir} has no manifest.json; export the model again (jmsnas export --model "
                              f"... --workdir {args.workdir})")
        export(args.workdir, export_dir)
    manifest = load_manifest(export_dir)
    if manifest.get("system") == "composed":  # a transmitted tensor's range is its batch's: the parts' batches
        whole = lambda: whole_of(args.workdir, manifest["batch"])
    analyses, outputs = [], None
    for s in args.bandwidth_scale:
        raw = run_pipeline(export_dir, images, bandwidth_scale=s, compute=compute, phase=args.phase,
                           timeout_s=args.timeout, base_port=args.base_port, window=args.window, hosts=hosts,
                           hosts_source=args.hosts or "the hosts", pacing=args.pacing,
                           connect_timeout_s=args.connect_timeout, predicted_compute_ms=predicted,
                           credentials=creds)
        a = separable.analyze(args.workdir, manifest, raw) if groups else analyze(manifest, raw, handoff, waits)
        if labels is not None:
            a["accuracy"] = float(np.mean(np.argmax(raw["outputs"].reshape(len(labels), -1), -1) == labels))
        outputs = raw["outputs"]
        if args.check:
            a["max_abs_diff"] = float(np.max(np.abs(outputs - whole()(images))))
            if not any("stages" in p for p in manifest["parts"].values()):  # one frame per link and image batch
                a["link_bytes"] = {name: {"predicted": want, "measured": a["measured"]["link_bytes"][name]}
                                   for name, want in ((f"{l['src']}->{l['dst']}", l["bytes"])
                                                      for l in manifest["links"])}
        analyses.append(a)
    out = os.path.join(args.workdir, "deploy")
    from jmsnas import safeio
    with safeio.write_errors(f"the pipeline's report to {out!r}"):
        os.makedirs(out, exist_ok=True)
        with safeio.atomic_write(os.path.join(out, "pipeline.json"), encoding="utf-8") as f:
            json.dump(analyses, f, indent=2)
        report.plot(analyses, manifest, os.path.join(out, "pipeline.png"))
    if args.json:
        print(json.dumps(analyses, indent=2))
        return 0
    print(report.format_table(analyses, manifest), end="")
    for a in analyses:
        extra = f", max |pipeline - whole network| = {a['max_abs_diff']:.2e}" if "max_abs_diff" in a else ""
        if "link_bytes" in a:
            off = {k: v for k, v in a["link_bytes"].items() if v["measured"] != [v["predicted"]]}
            extra += (", every link carried the predicted bytes" if not off else
                      ", links whose bytes differ from the prediction: " + ", ".join(
                          f"{k} {v['measured']} (predicted {v['predicted']})" for k, v in off.items()))
        acc = f"accuracy {a['accuracy']:.3f}" if "accuracy" in a else "no labels"
        print(f"bandwidth x{a['settings']['bandwidth_scale']:g}: {acc} on {args.images} test images{extra}")
    print(f"wrote {os.path.join(out, 'pipeline.json')} and pipeline.png")
    return 0
