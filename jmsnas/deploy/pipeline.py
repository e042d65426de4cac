"""The coordinator: one OS process per device (``jmsnas.deploy.worker``), TCP on 127.0.0.1 in the topology's shape.

``run_pipeline(export_dir, images, ...)`` starts the workers, connects them as the manifest's links say (chain;
mesh: the root sends to every branch, the aggregator waits for all of them), paces every link to
``bandwidth_scale`` x its bandwidth and its latency (``links``), optionally slows each device (``compute``), feeds
the images into the first device (the camera, an unthrottled local link) and collects the last device's outputs.

Two phases: ``latency`` sends one image batch at a time (nothing queues: the end-to-end time is eq. (1)/(2)'s T)
and ``stream`` keeps ``window`` batches in flight (pipelined throughput). Every worker reports, per image, its
compute start/end and for each input the sender's transmission start/end and the release time, so every term of
the equation is measured (``analysis.analyze``).

Faults end the run with one ``DeployError`` line naming the device: a worker that dies (exit code or signal), one
that makes no progress for ``timeout_s`` plus twice the slowest predicted stage (a compute or a link term) while
an image is in flight (hung), a part that fails to load, a port in
use. Every process started is ended before ``run_pipeline`` returns or raises (terminate, then kill).
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from jmsnas.deploy import links as L
from jmsnas.deploy.predict import predicted_links
from jmsnas.deploy.runtime import DeployError, load_manifest, sha256

PHASES = ("latency", "stream", "both")
CALIBRATION_CALLS, CALIBRATION_ROUNDS = 20, 2  # per device: the lower of two medians of 20 calls


def compute_targets(manifest: dict, compute, calib_ms: dict) -> tuple:
    """(stretch per device, predicted compute ms per device) for the ``compute`` setting.

    "host" (or 1): devices run at this machine's speed, predicted = the calibrated call time; a number S: every
    device runs S x slower than this machine; {device: S}: per device (others 1); "profile": every device is
    slowed to the run's cost-table time for its part (``predicted_compute_ms``), predicted = that time (a device
    whose host time is already longer runs at host speed and the prediction misses by the difference).
    """
    order = manifest["order"]
    if compute == "profile":
        target = {}
        for d in order:
            t = manifest["parts"][d].get("predicted_compute_ms")
            if t is None:
                raise DeployError(f"compute 'profile' needs the run's predicted compute of device {d!r}; the "
                                  "manifest has none")
            target[d] = float(t) * manifest["batch"]  # the table is per image, a call takes a batch
        return {d: max(1.0, target[d] / calib_ms[d]) if calib_ms[d] > 0 else 1.0 for d in order}, target
    if compute == "host":
        compute = 1.0
    scales = compute if isinstance(compute, dict) else {d: compute for d in order}
    unknown = sorted(set(scales) - set(order))
    if unknown:
        raise DeployError(f"compute scale names unknown devices {unknown}; devices: {order}")
    stretch = {}
    for d in order:
        s = scales.get(d, 1.0)
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 1.0:
            raise DeployError(f"compute scale of device {d!r} must be a number >= 1 (a device can only be slowed "
                              f"down), got {s!r}")
        stretch[d] = float(s)
    return stretch, {d: calib_ms[d] * stretch[d] for d in order}


def _check_settings(manifest, images, bandwidth_scale, phase, timeout_s, window) -> None:
    b = manifest["batch"]
    shape = manifest["parts"][manifest["order"][0]]["inputs"][0]["shape"]
    if images.ndim != 4 or list(images.shape[1:]) != shape[1:] or images.shape[0] == 0 or images.shape[0] % b:
        raise DeployError(f"images must be float32[N, {', '.join(map(str, shape[1:]))}] with N a positive multiple "
                          f"of the export batch {b}, got shape {list(images.shape)}")
    for name, v in (("bandwidth scale", bandwidth_scale), ("timeout", timeout_s), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
            raise DeployError(f"{name} must be a positive number, got {v!r}")
    if phase not in PHASES:
        raise DeployError(f"phase must be one of {PHASES}, got {phase!r}")


def _verify_files(export_dir: str, manifest: dict) -> None:
    """Every part's files exist and have their recorded SHA-256 (before any process starts)."""
    for d in manifest["order"]:
        entry = manifest["parts"][d]
        for key in ("program", "weights"):
            path = os.path.join(export_dir, str(entry.get(key)))
            if not os.path.isfile(path):
                raise DeployError(f"part {d!r}: file {path} is missing")
            if sha256(path) != entry.get(key + "_sha256"):
                raise DeployError(f"part {d!r}: file {path} is corrupt or does not match the manifest "
                                  "(SHA-256 differs from the recorded one)")


def _ports(manifest: dict, base_port: int) -> tuple:
    """(control port, {device: data port}); with a base port every port is checked free before anything starts."""
    order = manifest["order"]
    if not base_port:
        return 0, {d: 0 for d in order}
    if base_port + len(order) > 65535:
        raise DeployError(f"--base-port {base_port} leaves no room for the {len(order)} device ports after it "
                          f"(ports end at 65535); choose a --base-port <= {65535 - len(order)}")
    ports = {d: base_port + 1 + k for k, d in enumerate(order)}
    for who, port in [("the coordinator", base_port)] + [(f"device {d!r}", p) for d, p in ports.items()]:
        try:
            L.listen(port).close()
        except OSError as e:
            raise DeployError(f"port 127.0.0.1:{port} for {who} is in use ({e.strerror}); choose another "
                              "--base-port") from None
    return base_port, ports


class _Cluster:
    """The worker processes, their control connections and one event queue fed by a reader per connection."""

    def __init__(self, export_dir, manifest, control_port, ports, log_dir):
        self.manifest, self.order = manifest, manifest["order"]
        self.events: queue.Queue = queue.Queue()
        self.procs, self.ctl, self.logs = {}, {}, {}
        self.errors, self.bye, self.sent = {}, set(), []
        try:
            self.server = L.listen(control_port)
        except OSError as e:
            raise DeployError(f"port 127.0.0.1:{control_port} for the coordinator is in use ({e.strerror})") from None
        self.server.settimeout(0.2)
        port = self.server.getsockname()[1]
        for d in self.order:
            log = open(os.path.join(log_dir, f"{d}.log"), "wb")
            self.logs[d] = log
            cmd = [sys.executable, "-m", "jmsnas.deploy.worker", "--export", export_dir, "--device", d,
                   "--control", str(port), "--port", str(ports[d])]
            self.procs[d] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def pids(self) -> dict:
        return {d: p.pid for d, p in self.procs.items()}

    def _reader(self, conn) -> None:
        dev = None
        try:
            dev = L.recv_frame(conn).value["device"]
            self.ctl[dev] = conn
            self.events.put((dev, "connected", None))
            while True:
                self.events.put((dev, "frame", L.recv_frame(conn)))
        except (OSError, L.LinkClosed, KeyError, TypeError):
            self.events.put((dev, "eof", None))

    def accept_all(self, deadline: float) -> None:
        while len(self.ctl) < len(self.order):
            try:
                conn = L.accept(self.server)
                threading.Thread(target=self._reader, args=(conn,), daemon=True).start()
            except TimeoutError:
                pass
            except OSError:
                pass
            self.check_alive()
            while not self.events.empty():  # names arrive through the readers
                self.handle(self.events.get())
            if time.time() > deadline:
                missing = [d for d in self.order if d not in self.ctl]
                raise DeployError(f"devices {missing} did not start within the startup timeout")
            time.sleep(0.01)

    def handle(self, event):
        """Records an error / bye / EOF event; returns the frame for other events (None otherwise)."""
        dev, what, fr = event
        if what == "eof":
            if dev is not None and dev not in self.bye:
                self.errors.setdefault(dev, ("eof", "its control connection closed"))
            return None
        if what == "connected":
            return None
        if fr.kind == L.JSON and isinstance(fr.value, dict):
            if "error" in fr.value:
                self.errors.setdefault(dev, (fr.value.get("cause", "own"), fr.value["error"]))
                return None
            if fr.value.get("bye"):
                self.bye.add(dev)
                return None
        return dev, fr

    def check_alive(self) -> None:
        for d in self.order:
            rc = self.procs[d].poll()
            if rc is not None and d not in self.bye:
                self.errors.setdefault(d, ("exit", rc))
        if self.errors:
            raise _Failure()

    def send(self, dev, kind, image=-1, value=None):
        L.send_frame(self.ctl[dev], kind, image, value)

    def end(self) -> None:
        """Ends every process started (SIGTERM, then SIGKILL after 2 s) and closes the sockets and logs."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 2.0
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in list(self.ctl.values()) + [self.server]:
            s.close()
        for f in self.logs.values():
            f.close()


class _Failure(Exception):
    """Internal: a device failed; ``_diagnose`` turns it into one DeployError line."""


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _diagnose(cl: _Cluster, done: dict, in_flight, timeout_s: float | None) -> str:
    """One line naming the failing device: a dead process first, then an error of its own, then a hung one."""
    time.sleep(0.3)  # let the exits and error messages of the others settle
    while not cl.events.empty():
        cl.handle(cl.events.get())
    for d in cl.order:
        rc = cl.procs[d].poll()
        if rc is not None and d not in cl.bye:
            cl.errors.setdefault(d, ("exit", rc))
    img = f" while image {in_flight} was in flight" if in_flight is not None else " before the stream began"
    rc = {d: cl.procs[d].poll() for d in cl.order}
    kind = lambda d: cl.errors.get(d, ("",))[0]
    died = lambda d: (f"device {d!r} (pid {cl.procs[d].pid}) died ({_describe_exit(rc[d])}){img}; "
                      "the pipeline was stopped")
    for test, say in ((lambda d: rc[d] is not None and rc[d] < 0 and d not in cl.bye, died),
                      (lambda d: kind(d) == "own", lambda d: f"device {d!r}: {cl.errors[d][1]}"),
                      (lambda d: rc[d] is not None and d not in cl.bye, died),
                      (lambda d: d in cl.errors, lambda d: f"device {d!r}: {cl.errors[d][1]}")):
        hit = [d for d in cl.order if test(d)]
        if hit:
            return say(hit[0])
    # nothing died: the first device whose inputs all finished the image but that did not
    srcs = {d: [i["from"] for i in cl.manifest["parts"][d]["inputs"]] for d in cl.order}
    hung = [d for d in cl.order if in_flight not in done[d]
            and all(s == "image" or in_flight in done[s] for s in srcs[d])]
    d = hung[0] if hung else cl.order[0]
    return (f"device {d!r} (pid {cl.procs[d].pid}) made no progress on image {in_flight} for {timeout_s:.3g} s "
            "(its inputs were sent) and is hung; the pipeline was stopped")


def run_pipeline(export_dir: str, images: np.ndarray, *, bandwidth_scale: float = 1.0, compute="host",
                 phase: str = "both", timeout_s: float = 10.0, startup_timeout_s: float = 180.0,
                 base_port: int = 0, window: int = 8, on_start=None) -> dict:
    """Runs ``images`` float32[N, H, W, C] through the deployed parts; returns the raw measurement.

    Returns {"outputs": float32[N, ...] (latency phase, else stream), "records": {phase: {device: {image: rec}}},
    "calib_ms", "stretch", "predicted_compute_ms", "pids", "settings"}; ``analysis.analyze`` makes the table.
    ``on_start(pids)`` is called once the workers are connected (tests use it to inject faults).
    """
    manifest = load_manifest(export_dir)
    images = np.ascontiguousarray(images, np.float32)
    _check_settings(manifest, images, bandwidth_scale, phase, timeout_s, window)
    _verify_files(export_dir, manifest)
    control_port, ports = _ports(manifest, base_port)
    order, b = manifest["order"], manifest["batch"]
    with tempfile.TemporaryDirectory(prefix="jmsnas_pipeline_") as logs:
        cl = _Cluster(os.path.abspath(export_dir), manifest, control_port, ports, logs)
        done = {d: set() for d in order}
        in_flight, hang_s = None, timeout_s
        try:
            cl.accept_all(time.time() + startup_timeout_s)
            hello = _collect(cl, "hello", time.time() + startup_timeout_s)
            calib = {}
            for _ in range(CALIBRATION_ROUNDS):  # one device at a time, the others wait; the lower median
                for d in order:
                    cl.send(d, L.JSON, value={"calibrate": CALIBRATION_CALLS})
                    got = _collect(cl, "calib_ms", time.time() + startup_timeout_s, [d])[d]["calib_ms"]
                    calib[d] = min(calib.get(d, float("inf")), float(got))
            stretch, target = compute_targets(manifest, compute, calib)
            for d in order:
                part = manifest["parts"][d]
                out = {}
                for l in manifest["links"]:
                    if l["src"] == d:
                        out[l["dst"]] = [l["bandwidth_mbps"] * bandwidth_scale, l["latency_ms"]]
                inn = {l["src"]: l["latency_ms"] for l in manifest["links"] if l["dst"] == d}
                cl.send(d, L.JSON, value={"peers": {x: hello[x]["port"] for x in order}, "to": part["to"],
                                          "stretch": stretch[d], "out": out, "in": inn})
            src = L.connect(hello[order[0]]["port"])  # the camera: an unthrottled input of the first device
            L.send_frame(src, L.JSON, value={"from": "image"})
            _collect(cl, "ready", time.time() + startup_timeout_s)
            if on_start is not None:
                on_start(cl.pids())
            # no event for this long while an image is in flight = hung: the timeout plus twice the slowest stage
            stage_s = max([*predicted_links(manifest, bandwidth_scale).values(), *target.values()]) / 1e3
            hang_s = timeout_s + 2.0 * stage_s
            batches = [images[i:i + b] for i in range(0, len(images), b)]
            outputs, records, image_id = {}, {}, 0
            for ph in (("latency", "stream") if phase == "both" else (phase,)):
                win = 1 if ph == "latency" else int(window)
                ids = list(range(image_id, image_id + len(batches)))
                image_id += len(batches)
                res = _stream(cl, src, batches, ids, win, done, hang_s)
                outputs[ph] = np.concatenate([res[0][i] for i in ids])
                records[ph] = {d: {i - ids[0]: res[1][d][i] for i in ids} for d in order}
            L.send_frame(src, L.STOP)
            deadline = time.time() + hang_s
            while len(cl.bye) < len(order):
                try:
                    cl.handle(cl.events.get(timeout=0.05))
                except queue.Empty:
                    pass
                cl.check_alive()
                if time.time() > deadline:
                    late = [d for d in order if d not in cl.bye]
                    raise DeployError(f"devices {late} did not stop within {hang_s:.3g} s after the stream ended")
            src.close()
        except _Failure:
            in_flight = min((i for i in cl.sent if i not in done[order[-1]]), default=None)
            raise DeployError(_diagnose(cl, done, in_flight, hang_s)) from None
        except _Hung as h:
            raise DeployError(_diagnose(cl, done, h.image, hang_s)) from None
        finally:
            cl.end()
    first = "latency" if "latency" in outputs else "stream"
    return {"outputs": outputs[first], "stream_outputs": outputs.get("stream"), "records": records,
            "calib_ms": calib, "stretch": stretch, "predicted_compute_ms": target, "pids": cl.pids(),
            "settings": {"bandwidth_scale": float(bandwidth_scale), "compute": compute, "phase": phase,
                         "images": int(len(images)), "batch": b, "window": int(window)}}


class _Hung(Exception):
    def __init__(self, image):
        super().__init__(image)
        self.image = image


def _collect(cl: _Cluster, key: str, deadline: float, devices=None) -> dict:
    """{device: message} of the first message holding ``key`` from each of ``devices`` (default: all)."""
    devices = cl.order if devices is None else devices
    got = {}
    while len(got) < len(devices):
        try:
            ev = cl.handle(cl.events.get(timeout=0.05))
        except queue.Empty:
            ev = None
        if ev is not None and ev[0] in devices and ev[1].kind == L.JSON and key in ev[1].value:
            got[ev[0]] = ev[1].value
        cl.check_alive()
        if time.time() > deadline:
            missing = [d for d in devices if d not in got]
            raise DeployError(f"devices {missing} did not report {key!r} within the startup timeout")
    return got


def _stream(cl: _Cluster, src, batches, ids, window: int, done: dict, timeout_s: float) -> tuple:
    """Sends ``batches`` with at most ``window`` in flight; returns ({id: output}, {device: {id: record}})."""
    outputs, recs = {}, {d: {} for d in cl.order}
    last = cl.order[-1]
    sent, progress = 0, time.time()
    while len(outputs) < len(ids) or any(len(recs[d]) < len(ids) for d in cl.order):
        finished = sum(1 for i in ids if i in done[last])
        while sent < len(ids) and sent - finished < window:
            L.send_frame(src, L.ARRAY, ids[sent], batches[sent])
            cl.sent.append(ids[sent])
            sent += 1
            progress = time.time()
        try:
            ev = cl.handle(cl.events.get(timeout=0.05))
        except queue.Empty:
            ev = None
        cl.check_alive()
        if ev is not None:
            dev, fr = ev
            progress = time.time()
            if fr.kind == L.ARRAY:
                outputs[fr.image] = np.array(fr.value)
            elif isinstance(fr.value, dict) and "done" in fr.value:
                recs[dev][fr.image] = fr.value
                done[dev].add(fr.image)
        elif time.time() - progress > timeout_s:
            pending = [i for i in ids[:sent] if i not in done[last]]
            raise _Hung(pending[0] if pending else ids[min(sent, len(ids) - 1)])
    return outputs, recs
