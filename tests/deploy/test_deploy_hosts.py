"""Deployment across addresses: ``jmsnas worker --listen`` + ``jmsnas pipeline --hosts``, clock offsets, kernel-
shaped links in network namespaces (``netlab``), incompatible exports, and the one-line failures.

The namespace tests skip where namespaces cannot be made (not root, no iproute2); JMSNAS_REQUIRE_NETNS=1 (set by
.ci/run) turns that skip into a failure.
"""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jmsnas import cli, topology as T
from jmsnas.topology import presets
from jmsnas.deploy import auth, clock, links as L, netlab, reference
from jmsnas.deploy.export import export_run
from jmsnas.deploy.pipeline import run_pipeline
from jmsnas.deploy.runtime import DeployError, load_part
from test_deploy import make_run
from certs import make_tls

from paths import REPO
MARK = "JMSNAS_TEST_HOSTS_MARK"
SECRET = "namespace-lab-secret-0123456789abcdef"


# ----------------------------------------------------------------------------------------------- clock

def test_offset_estimate_is_within_its_uncertainty_of_the_true_offset():
    """Simulated clocks: worker = coordinator + theta; random asymmetric one-way delays. The estimate is off by
    at most its uncertainty, which is half the smallest round trip (a hand count on one exchange)."""
    rng = np.random.default_rng(0)
    for theta in (-3.7, 0.0, 1234.5):
        ex = []
        for k in range(16):
            t1 = 10.0 + k
            d1, d2, work = rng.uniform(1e-4, 5e-3), rng.uniform(1e-4, 5e-3), rng.uniform(0, 1e-3)
            t2 = t1 + theta + d1
            t3 = t2 + work
            ex.append((t1, t2, t3, t3 - theta + d2))
        est = clock.estimate_offset(ex)
        assert abs(est.offset_s - theta) <= est.uncertainty_s + 1e-12
        best = min(ex, key=lambda e: (e[3] - e[0]) - (e[2] - e[1]))
        assert est.uncertainty_s == pytest.approx(((best[3] - best[0]) - (best[2] - best[1])) / 2)
        assert clock.to_coordinator(ex[0][1], est) == pytest.approx(ex[0][0] + (ex[0][1] - ex[0][0] - theta),
                                                                    abs=est.uncertainty_s)
    # one exchange by hand: t1=0, t2=10.003 (theta 10, 3 ms out), t3=10.004, t4=0.005 (1 ms back)
    e = clock.estimate_offset([(0.0, 10.003, 10.004, 0.005)])
    assert e.offset_s == pytest.approx(10.001) and e.delay_s == pytest.approx(0.004)
    assert e.uncertainty_s == pytest.approx(0.002)


# ------------------------------------------------------------------------------------------ daemons

def _daemon(listen: str, env=None, lab=None, device=None, wait=True, flags=()):
    """A ``jmsnas worker --listen`` process (in ``lab``'s namespace of ``device`` if given), once it listens (with
    ``wait``)."""
    argv = [sys.executable, "-m", "jmsnas.cli", "worker", "--listen", listen, *flags]
    env = {**os.environ, MARK: mark_value(), "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **(env or {})}
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    proc = netlab.spawn(lab, device, argv, **kw) if lab else subprocess.Popen(argv, **kw)
    if wait:
        line = proc.stdout.readline()
        assert "listening on" in line, line
    return proc


def mark_value() -> str:
    """The value of a test file's mark in the environment of the daemons this test process starts: its pid, so
    that the tests another pytest worker runs at the same time (their own daemons and sessions) are not counted."""
    return str(os.getpid())


def _marked_sessions(mark: str = MARK) -> list:
    """Live session processes (``jmsnas.deploy.worker``) started by the daemons of a test file (its ``mark`` in
    their environment, set to ``mark_value()``) in this test process, in any namespace."""
    entry = f"{mark}={mark_value()}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if entry in env.split(b"\0") and b"jmsnas.deploy.worker" in cmd and state != "Z":
            found.append(int(pid))
    return found


def _no_session_left(timeout_s: float = 15.0):
    end = time.time() + timeout_s
    while _marked_sessions() and time.time() < end:
        time.sleep(0.05)
    left = _marked_sessions()
    assert left == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("chain"))
    make_run(d, "chain")
    export_run(d)
    return d


def _hosts_file(tmp_path, mapping, name="hosts.yaml"):
    p = tmp_path / name
    p.write_text(json.dumps(mapping) if name.endswith(".json") else
                 "".join(f"{k}: {v}\n" for k, v in mapping.items()))
    return str(p)


def _one_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_hosts_on_loopback_equal_the_whole_network(tiny, tmp_path):
    """Four daemons on 127.0.0.1 ports, the pipeline through --hosts: outputs == whole network, every clock offset
    estimated with its uncertainty, the end-to-end time taken at the coordinator; no session is left. It runs
    everywhere (7 s); where network namespaces can be made, the tests below check the same at distinct addresses."""
    procs = []
    try:
        ports = {}
        for d in ("ue", "sbs", "mbs", "cloud"):
            s = L.listen(0)
            ports[d] = s.getsockname()[1]
            s.close()
            procs.append(_daemon(f"127.0.0.1:{ports[d]}"))
        images, _ = reference.test_images(tiny, 20)
        raw = run_pipeline(os.path.join(tiny, "export"), images, bandwidth_scale=40.0, phase="latency",
                           hosts={d: f"127.0.0.1:{p}" for d, p in ports.items()})
        assert np.max(np.abs(raw["outputs"] - reference.whole_network(tiny)(images))) <= 1e-5
        for d, c in raw["clock"].items():  # one host: the true offset is 0
            assert c["exchanges"] == 16 and abs(c["offset_ms"]) <= c["uncertainty_ms"] + 1e-6
        co = raw["coordinator"]["latency"]
        first, last = raw["records"]["latency"]["ue"], raw["records"]["latency"]["cloud"]
        for i, (t_in, t_out) in co.items():  # the coordinator's span holds the devices' (mapped) span
            assert t_in <= first[i]["c0"] + raw["clock"]["ue"]["uncertainty_ms"] / 1e3
            assert last[i]["c1"] <= t_out + raw["clock"]["cloud"]["uncertainty_ms"] / 1e3
        _no_session_left()
    finally:
        for p in procs:  # their logs are shown when the test fails
            p.terminate()
            print(f"---- {p.args[-1]}\n{p.communicate()[0]}")


class _ModeWatched:
    """A socket that records every change of its blocking mode (settimeout, setblocking)."""

    def __init__(self, sock):
        self.sock, self.changes = sock, []

    def settimeout(self, t):
        self.changes.append(("settimeout", t))
        self.sock.settimeout(t)

    def setblocking(self, flag):
        self.changes.append(("setblocking", flag))
        self.sock.setblocking(flag)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_every_worker_hears_from_the_coordinator_before_any_part_is_sent(tmp_path):
    """A worker without a secret closes a connection that stays silent for its handshake time, and a session
    takes its part's files only once it has started: every session gets its first frame before any gets its files,
    so the last device does not wait for the others' sessions to start (here the first never reads at all).
    The sends never change a control connection's blocking mode: the coordinator's reader thread of that connection
    is in a blocking recv meanwhile, and one that found the descriptor non-blocking failed with EAGAIN, which read
    as 'device ... died or was cut off' on a loaded machine."""
    from jmsnas.deploy.pipeline import _Cluster
    order = ["a", "b", "c"]
    for d in order:
        for key in ("program", "weights"):
            (tmp_path / f"{d}.{key}").write_bytes(b"\0" * (4 << 20))  # more than a socket's buffers hold
    manifest = {"order": order, "parts": {d: {"program": f"{d}.program", "weights": f"{d}.weights"} for d in order}}
    cl = object.__new__(_Cluster)
    cl.manifest, cl.order = manifest, order
    pairs = {d: socket.socketpair() for d in order}
    cl.ctl = {d: _ModeWatched(pairs[d][0]) for d in order}
    read_errors = []

    def reader(sock):  # as _Cluster._reader: a blocking recv on the connection the frames are sent on
        try:
            while sock.recv(1 << 16):
                pass
        except OSError as e:
            read_errors.append(e)
    for d in order:
        threading.Thread(target=reader, args=(pairs[d][0],), daemon=True).start()
    try:
        with pytest.raises(DeployError, match="device 'a' did not take its part within the startup timeout"):
            cl.send_parts(str(tmp_path), time.time() + 1.0)
        for d in order:  # the worker end of every connection has its session's first frame
            pairs[d][1].settimeout(5.0)
            assert L.recv_frame(pairs[d][1]).value["part"] == d
        assert {d: cl.ctl[d].changes for d in order} == {d: [] for d in order}
        assert not [e for e in read_errors if isinstance(e, BlockingIOError)], read_errors
    finally:
        for a, b in pairs.values():
            a.close(), b.close()


def test_a_fault_while_the_parts_go_out_is_raised_to_the_caller(tmp_path, monkeypatch):
    """The sender thread's errors reach send_parts' caller: a part file that cannot be read as the export's own
    error naming the file and the device (not as a session that died), any other fault as it is."""
    from jmsnas.deploy.pipeline import _Cluster
    order = ["a", "b"]
    (tmp_path / "a.program").write_bytes(b"\0" * 16)
    (tmp_path / "a.weights").write_bytes(b"\0" * 16)
    manifest = {"order": order, "parts": {d: {"program": f"{d}.program", "weights": f"{d}.weights"} for d in order}}
    cl = object.__new__(_Cluster)
    cl.manifest, cl.order = manifest, order
    pairs = {d: socket.socketpair() for d in order}
    cl.ctl = {d: pairs[d][0] for d in order}
    def drain(sock):  # a session that reads everything, until its end is closed below
        with contextlib.suppress(OSError):
            while sock.recv(1 << 16):
                pass
    for _, far in pairs.values():  # so only the faults below stop the sends
        threading.Thread(target=drain, args=(far,), daemon=True).start()
    try:
        with pytest.raises(DeployError, match=r"part file '.*b\.program' of device 'b' cannot be read"):
            cl.send_parts(str(tmp_path), time.time() + 10.0)

        def broken(*args, **kwargs):
            raise ValueError("not a frame")
        monkeypatch.setattr(L, "send_frame", broken)
        with pytest.raises(ValueError, match="not a frame"):
            cl.send_parts(str(tmp_path), time.time() + 10.0)
    finally:
        for a, b in pairs.values():
            a.close(), b.close()


def test_refused_unresolvable_and_malformed_hosts_are_one_line(tiny, tmp_path, capsys):
    free = L.listen(0)
    port = free.getsockname()[1]
    free.close()
    base = {"ue": f"127.0.0.1:{port}", "sbs": f"127.0.0.1:{port}", "mbs": f"127.0.0.1:{port}",
            "cloud": f"127.0.0.1:{port}"}
    argv = ["pipeline", "--workdir", tiny, "--images", "2", "--connect-timeout", "1", "--hosts"]
    msg = _one_line(capsys, argv + [_hosts_file(tmp_path, base)])
    assert f"device 'ue': 127.0.0.1:{port}" in msg and "refused" in msg, msg
    msg = _one_line(capsys, argv + [_hosts_file(tmp_path, {**base, "ue": "no-such-host.invalid:7000"}, "h.json")])
    assert "device 'ue'" in msg and "'no-such-host.invalid'" in msg and "cannot be resolved" in msg, msg
    msg = _one_line(capsys, argv + [_hosts_file(tmp_path, {**base, "ue": "127.0.0.1:70000"}, "p.yaml")])
    assert "device 'ue'" in msg and "70000" in msg and "HOST:PORT" in msg, msg
    msg = _one_line(capsys, argv + [_hosts_file(tmp_path, {"ue": base["ue"]}, "m.yaml")])
    assert "missing ['sbs', 'mbs', 'cloud']" in msg, msg
    _no_session_left()


def test_a_hosts_file_is_read_with_the_capped_loader(tiny, tmp_path, capsys):
    """An alias bomb, /dev/zero and a 1 MB file as --hosts: one line each, exit 2, nothing read past the cap (the
    plain yaml.safe_load expanded the bomb and read /dev/zero until memory ran out)."""
    bomb = tmp_path / "bomb.yaml"  # ue: a list of 10^9 x's by aliases (a few hundred bytes, a small object graph)
    levels = ["&a [x, x, x, x, x, x, x, x, x, x]"] + [
        f"&{chr(97 + k)} [" + ", ".join([f"*{chr(96 + k)}"] * 10) + "]" for k in range(1, 9)]
    bomb.write_text("ue: [" + ", ".join(levels) + "]\nsbs: 127.0.0.1:7000\nmbs: 127.0.0.1:7000\n"
                    "cloud: 127.0.0.1:7000\n")
    big = tmp_path / "big.yaml"
    big.write_text("ue: 127.0.0.1:7000\n" + "# padding\n" * 100000)
    argv = ["pipeline", "--workdir", tiny, "--images", "2", "--hosts"]
    for path, message in ((bomb, "device 'ue' must be HOST:PORT"), ("/dev/zero", "larger than 65536 bytes"),
                          (big, "larger than 65536 bytes")):
        msg = _one_line(capsys, argv + [str(path)])
        assert message in msg and str(path) in msg, msg


@pytest.mark.slow
def test_a_part_from_an_incompatible_jax_is_one_line(tiny, tmp_path, capsys):
    """The manifest says the programs were made by a jax whose calling convention this one cannot run: loading
    names both versions and the command that exports again; through the pipeline: one line, exit 2, no process."""
    exp = tmp_path / "export"
    subprocess.run(["cp", "-r", os.path.join(tiny, "export"), str(exp)], check=True)
    m = json.loads((exp / "manifest.json").read_text())
    assert {"jax", "jaxlib", "serialization_version", "calling_convention_version"} <= set(m["versions"])
    assert m["platforms"] == ["cpu"]
    m["versions"].update(jax="9.9.0", jaxlib="9.9.0", calling_convention_version=99, serialization_version=99)
    (exp / "manifest.json").write_text(json.dumps(m))
    import jax
    with pytest.raises(DeployError) as e:
        load_part(str(exp), "sbs")
    msg = str(e.value)
    assert "\n" not in msg and "jax 9.9.0" in msg and f"jax {jax.__version__}" in msg
    assert f"jmsnas export --workdir {os.path.abspath(tiny)} --out {exp}" in msg
    line = _one_line(capsys, ["pipeline", "--workdir", tiny, "--export-dir", str(exp), "--images", "2"])
    # every part has the problem: the line names the session that reported it first (they start in parallel)
    assert re.match(r"jmsnas pipeline: error: device '(\w+)': part '\1' was exported by jax 9\.9\.0", line), line
    assert f"jax {jax.__version__}" in line and "jmsnas export --workdir" in line


# ------------------------------------------------------------------------------------ network namespaces

def _lab_or_skip(devices, links):
    reason = netlab.available()
    if reason:
        if os.environ.get("JMSNAS_REQUIRE_NETNS") == "1":
            pytest.fail(f"JMSNAS_REQUIRE_NETNS=1 but network namespaces cannot be used: {reason}")
        pytest.skip(f"network namespaces cannot be used here: {reason}")
    return netlab.create(devices, links)


PROBE = r"""
import sys, json, importlib.util
import numpy as np
spec = importlib.util.spec_from_file_location("links", sys.argv[-1])  # links alone: no jax to import
L = importlib.util.module_from_spec(spec); spec.loader.exec_module(L)
if sys.argv[1] == "recv":  # one connection after the other; per connection the receiver's rate of every frame
    srv = L.listen(0, sys.argv[2]); print(srv.getsockname()[1], flush=True)
    while True:
        conn = L.accept(srv); buf = L.FrameBuffer(); out = []
        while True:
            data = conn.recv(1 << 20)
            if not data: break
            out += [fr.rx_mbps for fr in buf.feed(data)]
        print(json.dumps(out), flush=True)
else:  # per line "host port bytes frames Mbit/s (0: no pacing)": a connection, its frames, its framing
    for line in sys.stdin:
        host, port, n, k, mbps = line.split()
        s = L.connect((host, int(port)))
        for _ in range(int(k)):
            L.send_frame(s, L.ARRAY, 0, np.zeros(int(n), np.uint8), L.Pace(float(mbps) or None))
        print(json.dumps(L.framing(s)), flush=True)
        s.close()
"""


class _Probe:
    """A receiver at ``host`` in ``dst``'s namespace and a sender in ``src``'s (None: this namespace)."""

    def __init__(self, lab, src, dst, host):
        kw = dict(stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
        run = lambda dev, *a: (netlab.spawn(lab, dev, [sys.executable, "-c", PROBE, *a, L.__file__], **kw) if dev
                               else subprocess.Popen([sys.executable, "-c", PROBE, *a, L.__file__], **kw))
        self.host, self.recv, self.send = host, run(dst, "recv", host), run(src, "send")
        self.port = int(self.recv.stdout.readline())

    def wire_rates(self, n: int, k: int, pace_mbps: float) -> list:
        """Wire Mbit/s of k frames of n bytes, each measured by the receiver alone (payload rate x wire bytes /
        payload bytes of that connection)."""
        self.send.stdin.write(f"{self.host} {self.port} {n} {k} {pace_mbps}\n")
        self.send.stdin.flush()
        mss, header = json.loads(self.send.stdout.readline())
        return [r * L.wire_bytes(n, mss, header) / n for r in json.loads(self.recv.stdout.readline())]

    def close(self):
        for p in (self.send, self.recv):
            p.kill()
            p.wait()


@pytest.mark.slow
def test_kernel_shaped_and_user_paced_links_agree_at_three_rates():
    """The same receiver-side measurement on a link shaped by tbf (no pacing in user space, from one namespace's
    address to another's) and a link paced in user space (loopback): each within 5% of the rate, and the two within
    5% of each other, at 5, 10 and 20 Mbit/s (median of three frames of 150 ms of link time)."""
    lab = _lab_or_skip(["a", "b"], {("a", "b"): 5.0})
    shaped, paced = _Probe(lab, "a", "b", lab.addresses["b"]), _Probe(None, None, None, "127.0.0.1")
    try:
        for rate in (5.0, 10.0, 20.0):
            netlab.set_rate(lab, "a", "b", rate)
            n = int(rate * 1e6 / 8 * 0.15)
            kernel = shaped.wire_rates(n, 3, 0)
            user = paced.wire_rates(n, 3, rate)
            k, u = float(np.median(kernel)), float(np.median(user))
            assert k == pytest.approx(rate, rel=0.05), (rate, kernel)
            assert u == pytest.approx(rate, rel=0.05), (rate, user)
            assert k == pytest.approx(u, rel=0.05), (rate, kernel, user)
    finally:
        shaped.close()
        paced.close()
        netlab.destroy(lab)
    assert not [ns for ns in lab.namespaces.values()
                if ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout]


@pytest.fixture(scope="module")
def chain3(tmp_path_factory):
    """A 3-device chain (ue -> sbs -> cloud, 4 and 8 Mbit/s, 32 KB activations: 66 and 33 ms of link time per
    image, long against a loaded machine's wake-up delays), every device in its own network
    namespace at its own address with a ``jmsnas worker --listen ADDRESS:7000``; the links shaped by tbf. The
    namespaces, daemons and sessions are removed at the end whatever happened."""
    rates = {("ue", "sbs"): 4.0, ("sbs", "cloud"): 8.0}
    lab = _lab_or_skip(["ue", "sbs", "cloud"], rates)
    try:
        run = str(tmp_path_factory.mktemp("chain3"))
        topo = T.chain("chain3", [presets.device("raspberry_pi4", "ue"), presets.device("xps15_rtx3050", "sbs"),
                                  presets.device("server_v100", "cloud")], [4.0, 8.0], [1, 1, 1])
        make_run(run, "chain", topo=topo, shapes=((128, 128, 128), (1, 1, 1)))
        export_run(run)
        secret = os.path.join(run, "secret")
        with open(secret, "w") as f:
            f.write(SECRET)
        tls = make_tls(os.path.join(run, "tls"), [lab.addresses[d] for d in ("ue", "sbs", "cloud")])
        tls_flags = ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]]
        procs = [_daemon(f"{lab.addresses[d]}:{port}", lab=lab, device=d, wait=False,
                         flags=["--secret-file", secret, *(tls_flags if port == 7001 else [])])
                 for d in ("ue", "sbs", "cloud") for port in (7000, 7001)]
        for proc in procs:
            line = proc.stdout.readline()
            assert "listening on" in line and "secret required" in line, line
        yield {"lab": lab, "run": run, "rates": rates, "secret": secret, "tls": tls,
               "credentials": auth.Credentials(SECRET.encode()),
               "hosts": {d: f"{lab.addresses[d]}:7000" for d in ("ue", "sbs", "cloud")},
               "tls_hosts": {d: f"{lab.addresses[d]}:7001" for d in ("ue", "sbs", "cloud")}}
    finally:
        netlab.destroy(lab)
        _no_session_left()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ns for ns in lab.namespaces.values() if ns in listed]


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["secret", "secret+tls"])
def test_namespace_chain_with_kernel_shaped_links(chain3, tmp_path, capsys, tls):
    """jmsnas pipeline --hosts --pacing network --check over three addresses, every connection authenticated by
    the secret (and encrypted by TLS, a certificate made here for the three addresses): outputs == the whole
    network, each link's measured wire Mbit/s within 10% of its tbf rate (TLS adds 0.5% to a payload; on a quiet
    machine within 5%, but the receiver's arrival times move when CI's two cores run other tests beside it: 5.1% once
    under TLS), every clock offset reported with its uncertainty."""
    where = chain3["tls_hosts" if tls else "hosts"]
    hosts = _hosts_file(tmp_path, where)
    assert cli.main(["pipeline", "--workdir", chain3["run"], "--hosts", hosts, "--pacing", "network", "--check",
                     "--phase", "latency", "--images", "12", "--json", "--secret-file", chain3["secret"],
                     *(["--tls-ca", chain3["tls"]["ca"]] if tls else [])]) == 0
    a = json.loads(capsys.readouterr().out)[0]
    assert a["max_abs_diff"] <= 1e-5
    for (src, dst), rate in chain3["rates"].items():
        got = a["measured"]["link_wire_mbps"][f"{src}->{dst}"]
        assert got == pytest.approx(rate, rel=0.10), (src, dst, got, a["measured"]["link_mbps"])
    assert a["where"] == where
    for d, c in a["clock"].items():  # one kernel, one clock: the true offset is 0
        assert abs(c["offset_ms"]) <= c["uncertainty_ms"] + 1e-6
    _no_session_left()


@pytest.mark.slow
def test_a_dead_worker_at_another_address_is_one_line(chain3):
    """The session of 'sbs' (at its own address) is killed mid-stream: one line naming the device, its address and
    pid; every other session ends too."""
    images, _ = reference.test_images(chain3["run"], 40)  # 40 x 66 ms on ue -> sbs: a 2.6 s stream
    pids = {}

    def start(p):
        pids.update(p)
        threading.Timer(0.4, lambda: os.kill(pids["sbs"], signal.SIGKILL)).start()

    with pytest.raises(DeployError) as e:
        run_pipeline(os.path.join(chain3["run"], "export"), images, phase="stream", pacing="network",
                     hosts=chain3["hosts"], on_start=start, timeout_s=30.0, credentials=chain3["credentials"])
    msg = str(e.value)
    assert msg.startswith(f"device 'sbs' at {chain3['hosts']['sbs']} (pid {pids['sbs']}) died"), msg
    assert "\n" not in msg
    _no_session_left()


@pytest.mark.slow
def test_an_unreachable_host_is_one_line(chain3, tmp_path, capsys):
    """A hosts file naming an address of the lab's subnet where no machine answers: one line, exit 2."""
    hosts = dict(chain3["hosts"], sbs=chain3["lab"].addresses["ue"].rsplit(".", 1)[0] + ".99:7000")
    msg = _one_line(capsys, ["pipeline", "--workdir", chain3["run"], "--connect-timeout", "1", "--hosts",
                             _hosts_file(tmp_path, hosts), "--secret-file", chain3["secret"]])
    assert f"device 'sbs': {hosts['sbs']}" in msg and ("did not answer" in msg or "unreachable" in msg), msg
    _no_session_left()


def test_two_labs_of_one_process_get_their_own_names_and_leave_none_behind():
    """Two labs made by one process at once (a test module after another in one pytest worker) each get their own
    interfaces and namespaces; destroying them leaves no interface or namespace of either behind."""
    first = _lab_or_skip(["a", "b"], {("a", "b"): 8.0})
    second = None
    try:
        second = netlab.create(["a", "b"], {("a", "b"): 8.0})
        assert second.tag != first.tag and second.bridge != first.bridge
        assert not set(first.namespaces.values()) & set(second.namespaces.values())
    finally:
        for lab in (second, first):
            if lab is not None:
                netlab.destroy(lab)
    lines = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    names = [line.split(": ")[1].split("@")[0] for line in lines]
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for lab in (first, second):
        assert not [n for n in names if n in (lab.bridge, *(f"j{lab.tag}{s}{i}" for s in "dp" for i in range(2)))]
        assert not set(lab.namespaces.values()) & set(spaces)
