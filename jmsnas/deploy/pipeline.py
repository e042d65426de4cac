"""The coordinator: one OS process per device (``jmsnas.deploy.worker``), TCP in the topology's shape.

``run_pipeline(export_dir, images, ...)`` starts the workers on 127.0.0.1 (or, with ``hosts`` {device: (host,
port)}, connects to a ``jmsnas worker --listen`` on each machine, which starts the session), sends every worker its
part's files, estimates every worker clock's offset from the coordinator's (``clock``: four timestamps per
exchange, the uncertainty reported; every worker time is mapped onto the coordinator's clock), connects them as
the manifest's links say (chain;
mesh: the root sends to every branch, the aggregator waits for all of them), paces every link to
``bandwidth_scale`` x its bandwidth and its latency (``links``; with ``pacing="network"`` nothing is paced in user
space: the kernel's shaper on the real links sets rate and latency), optionally slows each device (``compute``),
feeds the images into the first device (the camera, an unthrottled link) and collects the last device's outputs.
The end-to-end time of every image is taken at the coordinator alone (image sent -> output received).

Two phases: ``latency`` sends one image batch at a time (nothing queues: the end-to-end time is eq. (1)/(2)'s T)
and ``stream`` keeps ``window`` batches in flight (pipelined throughput). Every worker reports, per image, its
compute start/end and for each input the sender's transmission start/end and the release time, so every term of
the equation is measured (``analysis.analyze``).

Faults end the run with one ``DeployError`` line naming the device: a worker that dies (exit code or signal), one
that makes no progress for ``timeout_s`` plus twice the slowest predicted stage (a compute or a link term) while
an image is in flight (hung), a part that fails to load, a port in
use; with ``hosts``: a host that does not resolve, does not answer or refuses the connection, a worker whose
connection closes. Every process started is ended before ``run_pipeline`` returns or raises (terminate, then kill;
a remote session ends when its control connection closes).
"""
from __future__ import annotations

import contextlib
import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import ssl

import numpy as np

from jmsnas.deploy import auth, clock
from jmsnas.deploy.hosts import check_hosts
from jmsnas.deploy import links as L
from jmsnas.deploy.predict import cameras, predicted_links
from jmsnas.deploy.runtime import DeployError, check_file, load_manifest, part_files
from jmsnas.deploy.worker import connect_link

PHASES = ("latency", "stream", "both")
PACING = ("user", "network")  # user: the sender paces every link; network: the kernel's shaper does
CALIBRATION_CALLS, CALIBRATION_ROUNDS = 20, 2  # per device: the lower of two medians of 20 calls
CLOCK_EXCHANGES = 16  # four-timestamp exchanges per worker; the one with the shortest round trip gives the offset


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
    shape = image_shape(manifest)
    if list(images.shape[1:]) != shape or images.shape[0] == 0 or images.shape[0] % b:
        raise DeployError(f"images must be float32[N, {', '.join(map(str, shape))}] with N a positive multiple "
                          f"of the export batch {b}, got shape {list(images.shape)}")
    for name, v in (("bandwidth scale", bandwidth_scale), ("timeout", timeout_s), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
            raise DeployError(f"{name} must be a positive number, got {v!r}")
    if phase not in PHASES:
        raise DeployError(f"phase must be one of {PHASES}, got {phase!r}")


def image_shape(manifest: dict) -> list:
    """The shape of one image the pipeline takes: the manifest's ``image_shape`` (SplitNets: [V, s, s, C], one view
    per sensor) or the first part's input without the batch."""
    if "image_shape" in manifest:
        return [int(d) for d in manifest["image_shape"]]
    return [int(d) for d in manifest["parts"][manifest["order"][0]]["inputs"][0]["shape"][1:]]


def _ports(manifest: dict, base_port: int) -> dict:
    """{device: data port} (0: a free one); with a base port, consecutive ports from it, each checked free before
    anything starts."""
    order = manifest["order"]
    if not base_port:
        return {d: 0 for d in order}
    if base_port + len(order) - 1 > 65535:
        raise DeployError(f"--base-port {base_port} leaves no room for the {len(order)} device ports from it "
                          f"(ports end at 65535); choose a --base-port <= {65536 - len(order)}")
    ports = {d: base_port + k for k, d in enumerate(order)}
    for d, port in ports.items():
        try:
            L.listen(port).close()
        except OSError as e:
            raise DeployError(f"port 127.0.0.1:{port} for device {d!r} is in use ({e.strerror}); choose another "
                              "--base-port") from None
    return ports


def _connect_remote(device: str, addr: tuple, source: str, timeout_s: float, creds: auth.Credentials = auth.NONE):
    """The control connection to the ``jmsnas worker`` of ``device``, authenticated with ``creds`` (nothing is sent
    to a worker that does not prove the secret); DeployError (one line) if it cannot be made."""
    sock = _connect_plain(device, addr, source, timeout_s)
    try:
        if creds.secret is None:
            auth.check_no_secret_needed(sock)
        return auth.secure_client(sock, creds, addr[0], timeout_s)
    except (auth.AuthError, ssl.SSLError, OSError) as e:
        sock.close()
        hint = ("; give this command the worker's secret (--secret-file or $JMSNAS_SECRET)" if creds.secret is None
                else "; is the worker started with the same secret?")
        raise DeployError(f"device {device!r}: the jmsnas worker at {addr[0]}:{addr[1]} (from {source}) did not "
                          f"authenticate: {' '.join(str(e).split())}{hint}") from None


def _connect_plain(device: str, addr: tuple, source: str, timeout_s: float):
    host, port = addr
    where = f"device {device!r}: {host}:{port} (from {source})"
    try:
        socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DeployError(f"device {device!r}: host {host!r} (from {source}) cannot be resolved ({e.strerror})"
                          ) from None
    try:
        return L.connect((host, port), timeout_s=timeout_s, retry=False)
    except ConnectionRefusedError:
        raise DeployError(f"{where} refused the connection: no jmsnas worker listens on port {port} there "
                          f"(start one with: jmsnas worker --listen {host}:{port})") from None
    except (socket.timeout, TimeoutError):
        raise DeployError(f"{where} did not answer within {timeout_s:g} s (unreachable)") from None
    except OSError as e:
        why = {errno.EHOSTUNREACH: "the host is unreachable", errno.ENETUNREACH: "the network is unreachable"}
        raise DeployError(f"{where} cannot be reached: {why.get(e.errno, e.strerror or str(e))}") from None


class _Cluster:
    """The worker sessions, their control connections and one event queue fed by a reader per connection. A local
    session is a worker process given its end of a socket pair (as ``jmsnas worker`` hands a remote one the
    connection it accepted)."""

    def __init__(self, export_dir, manifest, ports, log_dir, hosts=None, connect_timeout_s=5.0,
                 hosts_source="the hosts", creds: auth.Credentials = auth.NONE):
        self.manifest, self.order = manifest, manifest["order"]
        self.events: queue.Queue = queue.Queue()
        self.procs, self.ctl, self.logs, self.where = {}, {}, {}, {}
        self.errors, self.bye, self.sent = {}, set(), []
        self.remote_pids: dict = {}
        # marks the processes of this export; the local sessions share the secret their data links prove
        env = auth.to_env(creds, {**os.environ, "JMSNAS_DEPLOY_EXPORT": export_dir})
        try:
            for d in self.order:
                if hosts is not None:
                    self.ctl[d] = _connect_remote(d, hosts[d], hosts_source, connect_timeout_s, creds)
                    self.where[d] = f"{hosts[d][0]}:{hosts[d][1]}"
                else:
                    self.ctl[d], theirs = socket.socketpair()
                    self.logs[d] = open(os.path.join(log_dir, f"{d}.log"), "wb")
                    cmd = [sys.executable, "-m", "jmsnas.deploy.worker", "--fd", str(theirs.fileno()), "--host",
                           "127.0.0.1", "--port", str(ports[d]), "--plain-control"]  # a socket pair: no TLS
                    with theirs:
                        self.procs[d] = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                                         stdout=self.logs[d], stderr=subprocess.STDOUT, env=env)
                    self.where[d] = "127.0.0.1"
                threading.Thread(target=self._reader, args=(self.ctl[d], d), daemon=True).start()
        except DeployError:
            self.end()
            raise

    def pids(self) -> dict:
        return {**{d: p.pid for d, p in self.procs.items()}, **self.remote_pids}

    def _reader(self, conn, dev) -> None:
        try:
            while True:
                self.events.put((dev, "frame", L.recv_frame(conn)))
        except (OSError, L.LinkClosed):
            self.events.put((dev, "eof", None))

    def handle(self, event):
        """Records an error / bye / EOF event; returns the frame for other events (None otherwise)."""
        dev, what, fr = event
        if what == "eof":
            if dev not in self.bye:
                self.errors.setdefault(dev, ("eof", "its control connection closed"))
            return None
        if fr.kind == L.JSON and isinstance(fr.value, dict):
            if "error" in fr.value:
                self.errors.setdefault(dev, (fr.value.get("cause", "own"), fr.value["error"]))
                return None
            if fr.value.get("bye"):
                self.bye.add(dev)
                return None
        return dev, fr

    def send_parts(self, export_dir: str, deadline: float) -> None:
        """Step 1 of the control protocol: every worker gets the manifest and its part's two files (a staged
        part: two per stage, in order); a session that has not taken them by ``deadline`` fails the startup.

        Every worker gets its first frame before any gets its files: a ``jmsnas worker`` without a secret closes a
        connection that stays silent for its handshake time, and a session's files wait until that session has
        started and reads them (seconds each on a loaded machine), which the last device must not wait for.
        The frames go out from a thread of their own, waited for until ``deadline``; a connection's timeout is
        never set: its reader thread shares the descriptor, and a blocking ``recv`` that finds it switched to
        non-blocking fails at once (an EAGAIN read as a closed connection)."""
        at, failed = [None], []

        def send_all() -> None:
            try:
                for d in self.order:
                    at[0] = d
                    L.send_frame(self.ctl[d], L.JSON, value={"part": d, "manifest": self.manifest})
                for d in self.order:
                    at[0] = d
                    for entry, key in part_files(self.manifest["parts"][d]):
                        path = os.path.join(export_dir, entry[key])
                        try:
                            with open(path, "rb") as f:
                                data = np.frombuffer(f.read(), np.uint8)
                        except OSError as e:  # the export's fault, not the session's
                            raise DeployError(f"part file {path!r} of device {d!r} cannot be read: "
                                              f"{e.strerror or e}") from None
                        L.send_frame(self.ctl[d], L.ARRAY, value=data)
                at[0] = None
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread below
                failed.append(e)
        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        sender.join(max(0.0, deadline - time.time()))
        if sender.is_alive():  # a session that does not read: the connections are shut, which ends the sender
            d = at[0]
            while sender.is_alive():
                with contextlib.suppress(OSError):
                    self.ctl[at[0] or d].shutdown(socket.SHUT_RDWR)
                sender.join(0.1)
            raise DeployError(f"device {d!r} did not take its part within the startup timeout")
        if failed and not isinstance(failed[0], OSError):  # not the connection's fault: raised here as it is
            raise failed[0]
        if failed:  # the session is gone: _diagnose names how
            raise _Failure()

    def check_alive(self, raise_: bool = True) -> None:
        """Records every process that exited without its bye as an error; _Failure when there is one (with
        ``raise_``)."""
        for d in self.procs:
            rc = self.procs[d].poll()
            if rc is not None and d not in self.bye:
                self.errors.setdefault(d, ("exit", rc))
        if self.errors and raise_:
            raise _Failure()

    def next_event(self):
        """The next event's (device, frame) (``handle``; None when none came within 50 ms or it was no frame),
        after which every process must still be alive (``check_alive``)."""
        try:
            ev = self.handle(self.events.get(timeout=0.05))
        except queue.Empty:
            ev = None
        self.check_alive()
        return ev

    def send(self, dev, kind, image=-1, value=None):
        try:
            L.send_frame(self.ctl[dev], kind, image, value)
        except OSError:  # the session is gone: _diagnose names how
            raise _Failure() from None

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
        for s in self.ctl.values():
            try:  # shutdown first: a reader thread blocked in recv would keep the connection open past close()
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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


def _who(cl: _Cluster, d: str) -> str:
    pid = cl.pids().get(d)
    at = f" at {cl.where[d]}" if d not in cl.procs else ""
    return f"device {d!r}{at}" + (f" (pid {pid})" if pid is not None else "")


def _diagnose(cl: _Cluster, done: dict, in_flight, timeout_s: float | None) -> str:
    """One line naming the failing device: a dead process first, then an error of its own, then a hung one."""
    time.sleep(0.3)  # let the exits and error messages of the others settle
    while not cl.events.empty():
        cl.handle(cl.events.get())
    cl.check_alive(raise_=False)
    img = f" while image {in_flight} was in flight" if in_flight is not None else " before the stream began"
    rc = {d: cl.procs[d].poll() if d in cl.procs else None for d in cl.order}
    kind = lambda d: cl.errors.get(d, ("",))[0]
    died = lambda d: f"{_who(cl, d)} died ({_describe_exit(rc[d])}){img}; the pipeline was stopped"
    cut = lambda d: (f"{_who(cl, d)} died or was cut off (its control connection closed without a word){img}; "
                     "the pipeline was stopped")
    for test, say in ((lambda d: rc[d] is not None and rc[d] < 0 and d not in cl.bye, died),
                      (lambda d: d not in cl.procs and kind(d) == "eof", cut),
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
    return (f"{_who(cl, d)} made no progress on image {in_flight} for {timeout_s:.3g} s "
            "(its inputs were sent) and is hung; the pipeline was stopped")


def _offsets(cl: _Cluster, deadline: float) -> dict:
    """{device: clock.Offset} from ``CLOCK_EXCHANGES`` four-timestamp exchanges with each worker in turn."""
    out = {}
    for d in cl.order:
        exchanges = []
        for _ in range(CLOCK_EXCHANGES):
            cl.send(d, L.JSON, value={"clock": L.now()})
            ev = _collect(cl, "clock", deadline, [d], frames=True)[d]
            t1, t2, t3 = ev.value["clock"]
            exchanges.append((t1, t2, t3, ev.arrival))
        out[d] = clock.estimate_offset(exchanges)
    return out


def _to_coordinator(records: dict, offsets: dict, order: list) -> dict:
    """Every worker time of the per-image records mapped onto the coordinator's clock (t - offset); the camera's
    ("image") times are the coordinator's own."""
    theta = {d: offsets[d].offset_s for d in order}
    theta["image"] = 0.0
    out = {}
    for d in order:
        out[d] = {}
        for i, rec in records[d].items():
            r = dict(rec, c0=rec["c0"] - theta[d], c1=rec["c1"] - theta[d])
            at = lambda s, v: [v[0] - theta[s], v[1] - theta[s], v[2] - theta[d], v[3] - theta[d], *v[4:]]
            r["in"] = {s: at(s, v) for s, v in rec["in"].items()}
            r["frames"] = {s: [at(s, v) for v in vs] for s, vs in rec.get("frames", {}).items()}
            out[d][i] = r
    return out


def run_pipeline(export_dir: str, images: np.ndarray, *, bandwidth_scale: float = 1.0, compute="host",
                 phase: str = "both", timeout_s: float = 10.0, startup_timeout_s: float = 180.0,
                 base_port: int = 0, window: int = 8, on_start=None, hosts=None, hosts_source: str = "the hosts",
                 pacing: str = "user", connect_timeout_s: float = 5.0, predicted_compute_ms: dict | None = None,
                 credentials: auth.Credentials | None = None) -> dict:
    """Runs ``images`` float32[N, H, W, C] through the deployed parts; returns the raw measurement.

    ``hosts``: {device: "HOST:PORT"} of ``jmsnas worker --listen`` processes (None: local processes on
    127.0.0.1); ``pacing``: "user" (the senders pace every link to bandwidth_scale x its bandwidth and latency) or
    "network" (nothing is paced in user space; the network, e.g. ``tc``, shapes the links);
    ``predicted_compute_ms`` {device: ms per image} (e.g. ``predict.table_prediction``): the prediction's compute
    terms, with every device at host speed (``compute`` must be "host"): the honest mode, nothing calibrated.

    Returns {"outputs": float32[N, ...] (latency phase, else stream), "records": {phase: {device: {image: rec}}}
    (every time on the coordinator's clock), "coordinator": {phase: {image: [sent, output received]}} (s, its
    clock), "clock": {device: {offset_ms, uncertainty_ms, delay_ms}}, "framing": {link: [MSS, header bytes]}, "calib_ms",
    "stretch", "predicted_compute_ms", "pids", "settings"}; ``analysis.analyze`` makes the table. ``on_start(pids)``
    is called once the workers are connected (tests use it to inject faults). ``credentials``
    (``jmsnas.deploy.auth``): the secret (and TLS) every connection to the ``hosts`` proves (default: from
    $JMSNAS_SECRET, else none); a local pipeline's processes share a fresh random secret of their own (or these
    credentials, TLS files included: their data links are then encrypted too).
    """
    manifest = load_manifest(export_dir)
    images = np.ascontiguousarray(images, np.float32)
    _check_settings(manifest, images, bandwidth_scale, phase, timeout_s, window)
    if pacing not in PACING:
        raise DeployError(f"pacing must be one of {PACING}, got {pacing!r}")
    if predicted_compute_ms is not None:
        if compute not in ("host", 1, 1.0):
            raise DeployError(f"a predicted compute (a latency table) runs every device at host speed; compute "
                              f"must be 'host', got {compute!r}")
        lacking = [d for d in manifest["order"] if d not in predicted_compute_ms]
        if lacking:
            raise DeployError(f"the predicted compute has no term for devices {lacking}")
    for d in manifest["order"]:  # every part's files exist and have their recorded SHA-256, before anything starts
        for entry, key in part_files(manifest["parts"][d]):
            check_file(export_dir, d, entry, key)
    hosts = None if hosts is None else check_hosts(hosts, manifest["order"], hosts_source)
    if hosts is None:  # the local processes' own secret (credentials=auth.NONE: none, a benchmark's baseline)
        creds = credentials if credentials is not None else auth.generated()
    else:
        creds = credentials if credentials is not None else auth.Credentials(auth.read_secret())
    ports = _ports(manifest, 0 if hosts is not None else base_port)
    order, b = manifest["order"], manifest["batch"]
    with tempfile.TemporaryDirectory(prefix="jmsnas_pipeline_") as logs:
        cl = _Cluster(os.path.abspath(export_dir), manifest, ports, logs, hosts, connect_timeout_s, hosts_source,
                      creds)
        done = {d: set() for d in order}
        in_flight, hang_s, src = None, timeout_s, []
        try:
            cl.send_parts(export_dir, time.time() + startup_timeout_s)
            hello = _collect(cl, "hello", time.time() + startup_timeout_s)
            if hosts is not None:
                cl.remote_pids.update({d: int(hello[d]["pid"]) for d in order})
            offsets = _offsets(cl, time.time() + startup_timeout_s)
            calib = {}
            for _ in range(CALIBRATION_ROUNDS):  # one device at a time, the others wait; the lower median
                for d in order:
                    cl.send(d, L.JSON, value={"calibrate": CALIBRATION_CALLS})
                    got = _collect(cl, "calib_ms", time.time() + startup_timeout_s, [d])[d]["calib_ms"]
                    calib[d] = min(calib.get(d, float("inf")), float(got))
            stretch, target = compute_targets(manifest, compute, calib)
            if predicted_compute_ms is not None:  # per image; a call takes a batch
                target = {d: float(predicted_compute_ms[d]) * b for d in order}
            for d in order:
                part = manifest["parts"][d]
                out = {}
                for l in manifest["links"]:
                    if l["src"] == d:
                        out[l["dst"]] = ([l["bandwidth_mbps"] * bandwidth_scale, l["latency_ms"]] if pacing == "user"
                                         else [None, 0.0])
                inn = {l["src"]: [l["latency_ms"] if pacing == "user" else 0.0,
                                  offsets[d].offset_s - offsets[l["src"]].offset_s]
                       for l in manifest["links"] if l["dst"] == d}
                cl.send(d, L.JSON, value={"peers": {x: [hello[x]["host"], hello[x]["port"]] for x in order},
                                          "to": part["to"], "stretch": stretch[d], "out": out, "in": inn})
            src = []
            for d, view in cameras(manifest):  # the camera: unthrottled, one link per part that takes the image
                src.append((connect_link((hello[d]["host"], hello[d]["port"]), creds,
                                         f"the camera's link to device {d!r}"), view))
                L.send_frame(src[-1][0], L.JSON, value={"from": "image"})
            ready = _collect(cl, "ready", time.time() + startup_timeout_s)
            if on_start is not None:
                on_start(cl.pids())
            # no event for this long while an image is in flight = hung: the timeout plus twice the slowest stage
            stage_s = max([*predicted_links(manifest, bandwidth_scale).values(), *target.values()]) / 1e3
            hang_s = timeout_s + 2.0 * stage_s
            batches = [images[i:i + b] for i in range(0, len(images), b)]
            outputs, records, at_coordinator, image_id = {}, {}, {}, 0
            for ph in (("latency", "stream") if phase == "both" else (phase,)):
                win = 1 if ph == "latency" else int(window)
                ids = list(range(image_id, image_id + len(batches)))
                image_id += len(batches)
                res = _stream(cl, src, batches, ids, win, done, hang_s)
                outputs[ph] = np.concatenate([res[0][i] for i in ids])
                recs = _to_coordinator(res[1], offsets, order)
                records[ph] = {d: {i - ids[0]: recs[d][i] for i in ids} for d in order}
                at_coordinator[ph] = {i - ids[0]: res[2][i] for i in ids}
            for sock, _ in src:
                L.send_frame(sock, L.STOP)
            deadline = time.time() + hang_s
            while len(cl.bye) < len(order):
                cl.next_event()
                if time.time() > deadline:
                    late = [d for d in order if d not in cl.bye]
                    raise DeployError(f"devices {late} did not stop within {hang_s:.3g} s after the stream ended")
        except _Failure:
            in_flight = min((i for i in cl.sent if i not in done[order[-1]]), default=None)
            raise DeployError(_diagnose(cl, done, in_flight, hang_s)) from None
        except _Hung as h:
            raise DeployError(_diagnose(cl, done, h.args[0], hang_s)) from None
        finally:
            for sock, _ in src:
                sock.close()
            cl.end()
    first = "latency" if "latency" in outputs else "stream"
    framing = {f"{s}->{d}": ready[d]["framing"][s] for d in order for s in ready[d].get("framing", {})}
    return {"outputs": outputs[first], "stream_outputs": outputs.get("stream"), "records": records,
            "coordinator": at_coordinator, "framing": framing,
            "clock": {d: {"offset_ms": o.offset_s * 1e3, "uncertainty_ms": o.uncertainty_s * 1e3,
                          "delay_ms": o.delay_s * 1e3, "exchanges": o.exchanges} for d, o in offsets.items()},
            "where": dict(cl.where), "calib_ms": calib, "stretch": stretch, "predicted_compute_ms": target,
            "pids": cl.pids(),
            "settings": {"bandwidth_scale": float(bandwidth_scale),
                         "compute": compute if predicted_compute_ms is None else "host, predicted by a table",
                         "phase": phase,
                         "images": int(len(images)), "batch": b, "window": int(window), "pacing": pacing,
                         "hosts": None if hosts is None else {d: f"{h}:{p}" for d, (h, p) in hosts.items()}}}


class _Hung(Exception):
    """Internal: no progress while image ``args[0]`` was in flight."""


def _collect(cl: _Cluster, key: str, deadline: float, devices=None, frames: bool = False) -> dict:
    """{device: message} (the frame with ``frames``) of the first message holding ``key`` from each of ``devices``
    (default: all)."""
    devices = cl.order if devices is None else devices
    got = {}
    while len(got) < len(devices):
        ev = cl.next_event()
        if ev is not None and ev[0] in devices and ev[1].kind == L.JSON and key in ev[1].value:
            got[ev[0]] = ev[1] if frames else ev[1].value
        if time.time() > deadline:
            missing = [d for d in devices if d not in got]
            raise DeployError(f"devices {missing} did not report {key!r} within the startup timeout")
    return got


def _stream(cl: _Cluster, src, batches, ids, window: int, done: dict, timeout_s: float) -> tuple:
    """Sends ``batches`` with at most ``window`` in flight; returns ({id: output}, {device: {id: record}},
    {id: [sent, output received]} on the coordinator's clock)."""
    outputs, recs, e2e = {}, {d: {} for d in cl.order}, {}
    last = cl.order[-1]
    sent, progress = 0, time.time()
    while len(outputs) < len(ids) or any(len(recs[d]) < len(ids) for d in cl.order):
        finished = sum(1 for i in ids if i in done[last])
        while sent < len(ids) and sent - finished < window:
            e2e[ids[sent]] = [min(L.send_frame(sock, L.ARRAY, ids[sent], batches[sent] if view is None else
                                               np.ascontiguousarray(batches[sent][:, view]))[0] for sock, view in src)]
            cl.sent.append(ids[sent])
            sent += 1
            progress = time.time()
        ev = cl.next_event()
        if ev is not None:
            dev, fr = ev
            progress = time.time()
            if fr.kind == L.ARRAY:
                outputs[fr.image] = np.array(fr.value)
                e2e[fr.image].append(fr.arrival)
            elif isinstance(fr.value, dict) and "done" in fr.value:
                recs[dev][fr.image] = fr.value
                done[dev].add(fr.image)
        elif time.time() - progress > timeout_s:
            pending = [i for i in ids[:sent] if i not in done[last]]
            raise _Hung(pending[0] if pending else ids[min(sent, len(ids) - 1)])
    return outputs, recs, e2e
