"""A worker that lets in only its coordinator (``jmsnas.deploy.auth``, ``daemon``): the HMAC handshake both ways,
TLS, the caps on what a peer can make a worker allocate, start or wait for, and the frame parser under fuzz.

Everything runs on 127.0.0.1; every request loop is bounded in count and time.
"""
import os
import resource
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax import export

from jmsnas import cli
from jmsnas.deploy import auth, links as L, timer

from paths import REPO
from test_deploy_hosts import _marked_sessions, mark_value, tiny  # noqa: F401 - tiny: an exported 4-device chain (a fixture)
from certs import make_tls
MARK = "JMSNAS_TEST_AUTH_MARK"
SECRET = b"correct-horse-battery-staple-0123456789"


def _free_port() -> int:
    s = L.listen(0)
    port = s.getsockname()[1]
    s.close()
    return port


def _daemon(tmp_path, *flags, secret=SECRET, env=None, limit_files=None):
    """A ``jmsnas worker`` on a free 127.0.0.1 port (its sessions write their parts under tmp_path/tmp); returns
    (process, port)."""
    port = _free_port()
    argv = [sys.executable, "-m", "jmsnas.cli", "worker", "--listen", f"127.0.0.1:{port}", *flags]
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, MARK: mark_value(), "TMPDIR": str(tmp), "PYTHONPATH": REPO + os.pathsep + os.environ.get(
        "PYTHONPATH", ""), **(env or {})}
    env.pop(auth.ENV, None)
    if secret is not None:
        (tmp_path / "secret").write_bytes(secret + b"\n")
        argv += ["--secret-file", str(tmp_path / "secret")]
    if limit_files:  # the worker's own soft limit of open files, set before it starts
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        argv[1:3] = ["-c", f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
                           f"({limit_files}, {hard})); sys.argv[0] = 'jmsnas'; "
                           f"runpy.run_module('jmsnas.cli', run_name='__main__')"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, port


def _stop(proc) -> str:
    """Ends a daemon; its stderr."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def _sessions() -> list:
    """Live session processes started by this file's daemons."""
    return _marked_sessions(MARK)


@pytest.fixture(scope="module")
def program():
    """A tiny jax.export program as ``jmsnas measure --remote`` sends it."""
    prog = export.export(jax.jit(lambda x: jnp.tanh(x * 2.0)))(jax.ShapeDtypeStruct((4, 4), jnp.float32))
    return bytes(prog.serialize())


def _send_part(sock, blob) -> None:
    """The control protocol's first step: a part (a timed program) and its two files."""
    manifest, prog, weights = timer.program_part(blob)
    L.send_frame(sock, L.JSON, -1, {"part": timer.PART, "manifest": manifest})
    for b in (prog, weights):
        L.send_frame(sock, L.ARRAY, -1, np.frombuffer(b, np.uint8))


def _drain(sock, limit_s: float = 15.0) -> bytes:
    """Everything the peer sends until it closes (at most ``limit_s``)."""
    got, end = b"", time.monotonic() + limit_s
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, TimeoutError):
            break
        except OSError:  # reset: it closed with bytes of ours unread
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the worker kept the connection open past {limit_s} s ({len(got)} bytes)")


# ------------------------------------------------------------------------------------------ handshake

def test_the_handshake_proves_the_secret_both_ways():
    """Socket pairs: the same secret passes both ways; a wrong one fails on both sides, with one line that never
    holds the secret."""
    for client_secret, ok in ((SECRET, True), (b"x" * 32, False)):
        a, b = socket.socketpair()
        errors = []
        t = threading.Thread(target=lambda: _catch(errors, auth.server_handshake, a, SECRET, 5.0))
        t.start()
        try:
            auth.client_handshake(b, client_secret, 5.0)
        except auth.AuthError as e:
            errors.append(e)
        t.join(10)
        a.close(), b.close()
        assert (not errors) == ok, errors
        for e in errors:
            assert SECRET.decode() not in str(e) and "\n" not in str(e)


def _catch(errors, fn, sock, *a):
    try:
        fn(sock, *a)
    except auth.AuthError as e:
        errors.append(e)
        sock.shutdown(socket.SHUT_RDWR)  # as the worker closes a refused peer


@pytest.mark.parametrize("content, message", [
    (b"short", "a secret must be 16-4096 bytes"),
    (b"has a space inside it 123", "printable text without spaces"),
])
def test_a_weak_or_missing_secret_is_one_line(tmp_path, content, message):
    p = tmp_path / "s"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        auth.read_secret(str(p), env={})
    assert content.decode() not in str(e.value)
    with pytest.raises(ValueError, match="cannot read it"):
        auth.read_secret(str(tmp_path / "missing"), env={})
    assert auth.read_secret(None, env={}) is None
    assert auth.read_secret(None, env={auth.ENV: SECRET.decode()}) == SECRET


# ------------------------------------------------------------------------------------------ the worker

def test_a_peer_without_the_secret_gets_nothing_and_starts_no_process(tmp_path, program):
    """A peer that sends a part straight away (as any client did before), and one that answers the challenge with
    a wrong secret, get the challenge and a closed connection: no session process, no part file; the worker says
    so in one line each. The coordinator that holds the secret then times the same program."""
    proc, port = _daemon(tmp_path)
    try:
        anonymous = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            _send_part(anonymous, program)
        except OSError:
            pass  # the worker may close while the part is still being sent
        got = _drain(anonymous)
        assert got.startswith(auth.MAGIC) and len(got) == auth.HELLO  # the challenge, nothing else
        wrong = socket.create_connection(("127.0.0.1", port), timeout=5)
        with pytest.raises(auth.AuthError, match="closed the connection instead of sending its proof"):
            auth.client_handshake(wrong, b"w" * 32, 5.0)
        assert _drain(wrong) == b""
        assert _sessions() == [] and os.listdir(tmp_path / "tmp") == []
        ms = timer.time_programs(f"127.0.0.1:{port}", [program], reps=2, warmup=0,
                                 credentials=auth.Credentials(SECRET))
        assert len(ms) == 1 and ms[0] > 0
    finally:
        err = _stop(proc)
    refused = [line for line in err.splitlines() if "refused" in line]
    assert len(refused) == 2 and all("does not hold the secret" in r or "no jmsnas handshake" in r
                                     for r in refused), err
    assert SECRET.decode() not in err
    assert os.listdir(tmp_path / "tmp") == []


def test_a_client_without_the_secret_is_told_the_worker_requires_one(tmp_path, program, monkeypatch):
    """measure --remote's timer and pipeline --hosts without a secret, at a worker that requires one: one line
    saying so, nothing sent (the worker logs no refused answer: the client hung up before answering)."""
    from jmsnas.deploy.pipeline import _connect_remote
    from jmsnas.deploy.runtime import DeployError
    monkeypatch.delenv(auth.ENV, raising=False)
    proc, port = _daemon(tmp_path)
    try:
        with pytest.raises(ValueError, match="requires a shared secret and none was given.*--secret-file"):
            timer.time_programs(f"127.0.0.1:{port}", [program], reps=1)
        with pytest.raises(DeployError, match="device 'ue': the jmsnas worker at .* requires a shared secret"):
            _connect_remote("ue", ("127.0.0.1", port), "hosts.yaml", 5.0)
        assert _sessions() == []
    finally:
        err = _stop(proc)
    assert "refused" not in err, err


def test_a_rogue_worker_without_the_secret_receives_no_part(tiny):
    """A 'worker' that does not hold the secret (silent, or sending a challenge of its own) gets the coordinator's
    nonce and MAC at most, never a frame of a part; the coordinator fails in one line naming the device."""
    from jmsnas.deploy.pipeline import run_pipeline
    run = tiny
    for speaks in (False, True):
        server = L.listen(0)
        got = []

        def rogue():
            conn, _ = server.accept()
            if speaks:
                conn.sendall(auth.server_hello()[0])
            conn.settimeout(8.0)
            data = b""
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
            got.append(data)
            conn.close()
        t = threading.Thread(target=rogue, daemon=True)
        t.start()
        hosts = {d: f"127.0.0.1:{server.getsockname()[1]}" for d in ("ue", "sbs", "mbs", "cloud")}
        from jmsnas.deploy.runtime import DeployError
        with pytest.raises(DeployError, match="device 'ue': the jmsnas worker at .* did not authenticate") as e:
            run_pipeline(os.path.join(run, "export"), np.zeros((1, 8, 8, 1), np.float32), hosts=hosts,
                         connect_timeout_s=1.0, credentials=auth.Credentials(SECRET))
        assert "\n" not in str(e.value)
        t.join(15)
        server.close()
        assert got and L.MAGIC not in got[0] and len(got[0]) <= auth.ANSWER, got


def test_500_idle_or_half_open_connections_do_not_stop_a_real_coordinator(tmp_path, program):
    """500 connections that stay silent or stop half-way through the handshake, against a worker allowed 64 open
    files (the old one died of EMFILE at about 1,020): a coordinator with the secret is still served, and the
    worker holds a few threads (not one per connection), no session process for the flood, and a bounded number of descriptors."""
    proc, port = _daemon(tmp_path, limit_files=64)
    flood = []
    try:
        for k in range(500):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue  # a full backlog may refuse some: that is the worker shedding load
            if k % 2:
                s.setblocking(False)
                try:
                    s.send(auth.MAGIC + bytes([auth.VERSION]) + b"\0" * 10)  # half an answer
                except OSError:
                    pass
            flood.append(s)
        assert len(flood) >= 100
        ms = timer.time_programs(f"127.0.0.1:{port}", [program], reps=2, warmup=0,
                                 credentials=auth.Credentials(SECRET))
        assert len(ms) == 1
        assert proc.poll() is None
        with open(f"/proc/{proc.pid}/status") as f:
            threads = int([line for line in f if line.startswith("Threads:")][0].split()[1])
        assert threads <= 4  # the loop's one and numpy's BLAS pool, not one per connection
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= 64
        assert len(_sessions()) <= 1
    finally:
        for s in flood:
            s.close()
        err = _stop(proc)
    assert "Traceback" not in err, err


def test_a_silent_peer_is_dropped_after_the_handshake_time(tmp_path, program):
    """A connection that sends nothing, and one that stops half-way through its answer, are closed once the
    handshake time has passed (--handshake-timeout 0.5; default 10 s, the old worker waited an hour); the worker
    serves on and logs nothing for them (a port scan is no event)."""
    proc, port = _daemon(tmp_path, "--handshake-timeout", "0.5")
    try:
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(auth.MAGIC + bytes([auth.VERSION]) + b"\0" * 20)
        for s in (silent, half):
            assert len(_drain(s, limit_s=30.0)) == auth.HELLO  # the challenge, then closed
            s.close()
        assert len(timer.time_programs(f"127.0.0.1:{port}", [program], reps=1, warmup=0,
                                       credentials=auth.Credentials(SECRET))) == 1
    finally:
        err = _stop(proc)
    assert "refused" not in err and "Traceback" not in err, err


def test_a_full_worker_tells_the_coordinator_in_one_line(tmp_path, program):
    """--max-sessions 1: a second coordinator while a session runs is told the worker is busy."""
    proc, port = _daemon(tmp_path, "--max-sessions", "1")
    try:
        first = auth.secure_client(socket.create_connection(("127.0.0.1", port), timeout=5),
                                   auth.Credentials(SECRET))
        _send_part(first, program)
        assert "hello" in L.recv_frame(first).value
        with pytest.raises(ValueError, match=r"failed: the jmsnas worker at .* is busy: 1 sessions run \(at most 1\)"):
            timer.time_programs(f"127.0.0.1:{port}", [program], reps=1, credentials=auth.Credentials(SECRET))
        first.close()
    finally:
        _stop(proc)


def test_a_session_ended_by_sigterm_leaves_no_part_file(tmp_path, program):
    """The session's temporary folder (the peer's program and weights) is removed when SIGTERM ends it."""
    proc, port = _daemon(tmp_path)
    try:
        conn = auth.secure_client(socket.create_connection(("127.0.0.1", port), timeout=5), auth.Credentials(SECRET))
        _send_part(conn, program)
        pid = L.recv_frame(conn).value["pid"]
        assert [n for n in os.listdir(tmp_path / "tmp") if n.startswith("jmsnas_part_")]
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 90
        while pid in _sessions() and time.monotonic() < end:
            time.sleep(0.05)
        assert pid not in _sessions()
        assert os.listdir(tmp_path / "tmp") == []
        conn.close()
    finally:
        _stop(proc)


def test_a_malformed_frame_ends_the_session_with_one_line(tmp_path):
    """An authenticated peer's frame claiming 100 GB, and one that is no frame: the session ends, the worker's log
    has one line for it, the worker serves on."""
    proc, port = _daemon(tmp_path)
    try:
        for junk in (L._HEAD.pack(L.MAGIC, L.ARRAY, 0, 3, 2) + struct.pack("<2I", 10 ** 5, 10 ** 6) +
                     L._LEN.pack(100 * 10 ** 9),
                     b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 64):
            conn = auth.secure_client(socket.create_connection(("127.0.0.1", port), timeout=5),
                                      auth.Credentials(SECRET))
            conn.sendall(junk)
            _drain(conn, limit_s=90.0)  # the session's error message (or a reset, when our junk is left unread), then closed
        end = time.monotonic() + 90
        while _sessions() and time.monotonic() < end:
            time.sleep(0.05)
        assert _sessions() == [] and proc.poll() is None
    finally:
        err = _stop(proc)
    ended = [line for line in err.splitlines() if "session ended" in line]
    assert len(ended) == 2 and "100000000000 payload bytes" in ended[0] and "not a jmsnas frame" in ended[1], err
    assert "Traceback" not in err, err
    assert os.listdir(tmp_path / "tmp") == []


def test_the_worker_listens_on_loopback_unless_told_and_refuses_an_open_address_without_a_secret(tmp_path):
    """--listen PORT is 127.0.0.1:PORT; --listen 0.0.0.0:PORT without a secret is one line saying how to make one
    (before it listens); with a secret it listens."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(auth.ENV, None)
    r = subprocess.run([sys.executable, "-m", "jmsnas.cli", "worker", "--listen", "0.0.0.0:0"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1 and "needs a shared secret" in r.stderr
    assert "head -c 32 /dev/urandom" in r.stderr
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "worker", "--listen", str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert f"listening on 127.0.0.1:{port}" in p.stdout.readline()
    finally:
        _stop(p)
    (tmp_path / "s").write_text(SECRET.decode())
    p = subprocess.Popen([sys.executable, "-m", "jmsnas.cli", "worker", "--listen", f"0.0.0.0:{port}",
                          "--secret-file", str(tmp_path / "s")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert "secret required" in p.stdout.readline()
    finally:
        _stop(p)


# ------------------------------------------------------------------------------------------ frames

def test_a_frame_claiming_100_gb_is_refused_without_allocating_it():
    """The parser refuses a declared size over the cap from the header alone; a size under the cap that never
    arrives costs what arrived, not what was declared."""
    for kind, code, shape, n in ((L.ARRAY, 3, (10 ** 5, 10 ** 6), 100 * 10 ** 9), (L.JSON, 0, (), 100 * 10 ** 9),
                                 (L.ARRAY, 3, (8,), 9)):
        head = L._HEAD.pack(L.MAGIC, kind, 0, code, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
        a, b = socket.socketpair()
        b.sendall(head + L._LEN.pack(n))
        tracemalloc.start()
        with pytest.raises(L.LinkClosed, match="payload bytes"):
            L.recv_frame(a)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
        tracemalloc.stop()
        a.close(), b.close()
    a, b = socket.socketpair()  # 1 GB declared (under the cap), 10 bytes sent, then closed
    b.sendall(L._HEAD.pack(L.MAGIC, L.ARRAY, 0, 3, 1) + struct.pack("<I", 10 ** 9) + L._LEN.pack(10 ** 9) + b"x" * 10)
    b.close()
    tracemalloc.start()
    with pytest.raises(L.LinkClosed):
        L.recv_frame(a)
    assert tracemalloc.get_traced_memory()[1] < 16 << 20
    tracemalloc.stop()
    a.close()


_frames = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda k, code, shape, n, tail: L._HEAD.pack(L.MAGIC, k, 0, code, len(shape))
              + struct.pack(f"<{len(shape)}I", *shape) + L._LEN.pack(n) + tail,
              st.integers(0, 4), st.integers(0, 6), st.lists(st.integers(0, 2 ** 32 - 1), max_size=4),
              st.integers(0, 2 ** 64 - 1), st.binary(max_size=64)),
    st.builds(lambda v, cut: _whole(v)[:cut], st.one_of(st.none(), st.integers(), st.text(max_size=20)),
              st.integers(0, 80)))


def _whole(value) -> bytes:
    a, b = socket.socketpair()
    L.send_frame(a, L.JSON, 1, value)
    a.close()
    out = b""
    while chunk := b.recv(4096):
        out += chunk
    b.close()
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_frames, split=st.integers(1, 50))
def test_fuzz_the_frame_parser_never_crashes(data, split):
    """Any bytes, whole or fed in pieces: frames, a need for more bytes, or LinkClosed; nothing else."""
    try:
        got = L._parse(bytearray(data))
        assert isinstance(got, int) or isinstance(got[0], L.Frame)
    except L.LinkClosed:
        pass
    buf = L.FrameBuffer()
    try:
        for i in range(0, len(data), split):
            for fr in buf.feed(data[i:i + split]):
                assert isinstance(fr, L.Frame)
    except L.LinkClosed:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=120),
                      st.builds(lambda tail: auth.MAGIC + bytes([auth.VERSION]) + tail, st.binary(max_size=80))),
       close=st.booleans())
def test_fuzz_the_handshake_never_crashes_or_waits_past_its_time(data, close):
    """A server handshake fed any bytes (then closed, or left silent) ends in AuthError within its time."""
    a, b = socket.socketpair()
    b.sendall(data)
    if close:
        b.shutdown(socket.SHUT_WR)
    t0 = time.monotonic()
    with pytest.raises(auth.AuthError):
        auth.server_handshake(a, SECRET, 0.05)
    assert time.monotonic() - t0 < 30  # a bound, not a timing: it did not hang
    a.close(), b.close()


def test_fuzz_the_workers_handshake_then_serve(tmp_path, program):
    """Random bytes (and random cuts of a right answer) at a running worker: it never starts a session for them,
    never dies, and then serves a coordinator with the secret."""
    import random
    rng = random.Random(0)
    proc, port = _daemon(tmp_path)
    try:
        for k in range(60):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            hello = s.recv(auth.HELLO)
            answer = bytearray(auth.MAGIC + bytes([auth.VERSION]) + rng.randbytes(64))
            if k % 3 == 0:
                answer = bytearray(rng.randbytes(rng.randrange(0, 200)))
            elif k % 3 == 1:  # a right answer with one byte flipped
                nonce_c = rng.randbytes(32)
                answer = bytearray(auth.MAGIC + bytes([auth.VERSION]) + nonce_c
                                   + auth._mac(SECRET, b"client", hello[5:], nonce_c))
                answer[rng.randrange(len(answer))] ^= 1 << rng.randrange(8)
            try:
                s.sendall(bytes(answer))
            except OSError:
                pass
            s.close()
        assert proc.poll() is None and _sessions() == []
        assert len(timer.time_programs(f"127.0.0.1:{port}", [program], reps=1, warmup=0,
                                       credentials=auth.Credentials(SECRET))) == 1
    finally:
        err = _stop(proc)
    assert "Traceback" not in err, err


# ------------------------------------------------------------------------------------------ TLS

def test_tls_pipeline_and_timing_through_one_worker(tmp_path, program, tiny):
    """A worker with the secret and TLS (a certificate made here): a 4-device pipeline through it (control and
    data links encrypted) equals the whole network; measure --remote times through it; a client with the secret
    but without TLS, or trusting another CA, is refused in one line and starts nothing."""
    from jmsnas.deploy import reference
    from jmsnas.deploy.pipeline import run_pipeline
    tls = make_tls(tmp_path / "tls")
    other = make_tls(tmp_path / "other")
    run = tiny
    proc, port = _daemon(tmp_path, "--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"])
    creds = auth.Credentials(SECRET, ca=tls["ca"])
    try:
        images, _ = reference.test_images(run, 6)
        raw = run_pipeline(os.path.join(run, "export"), images, bandwidth_scale=40.0, phase="both", window=3,
                           hosts={d: f"127.0.0.1:{port}" for d in ("ue", "sbs", "mbs", "cloud")}, credentials=creds)
        assert np.max(np.abs(raw["outputs"] - reference.whole_network(run)(images))) <= 1e-5
        assert len(timer.time_programs(f"127.0.0.1:{port}", [program], reps=1, warmup=0, credentials=creds)) == 1
        with pytest.raises(ValueError, match="did not authenticate: .*certificate verify failed") as e:
            timer.time_programs(f"127.0.0.1:{port}", [program], credentials=auth.Credentials(SECRET, ca=other["ca"]))
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="closed") as e:  # plain frames into a TLS session
            timer.time_programs(f"127.0.0.1:{port}", [program], timeout_s=90, credentials=auth.Credentials(SECRET))
        assert "\n" not in str(e.value)
        end = time.monotonic() + 90
        while _sessions() and time.monotonic() < end:
            time.sleep(0.05)
        assert _sessions() == []
    finally:
        err = _stop(proc)
    assert "Traceback" not in err and SECRET.decode() not in err, err
    assert os.listdir(tmp_path / "tmp") == []


def test_tls_flags_are_checked_before_anything_listens(tmp_path, capsys):
    """A worker given a certificate without its key, or TLS without a secret: one line, exit 2."""
    tls = make_tls(tmp_path / "tls")
    (tmp_path / "s").write_text(SECRET.decode())
    for argv, message in ((["--tls-cert", tls["cert"], "--tls-ca", tls["ca"], "--secret-file", str(tmp_path / "s")],
                           "missing --tls-key"),
                          (["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]],
                           "TLS needs the shared secret"),
                          (["--tls-cert", tls["ca"], "--tls-key", tls["key"], "--tls-ca", tls["ca"],
                            "--secret-file", str(tmp_path / "s")], "cannot be used")):
        os.environ.pop(auth.ENV, None)
        assert cli.main(["worker", "--listen", "127.0.0.1:0", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_measure_remote_against_a_silent_or_closing_peer_is_one_line(tmp_path, capsys):
    """jmsnas measure --remote at a peer that accepts and never answers, and at one that closes at once: one line
    naming the address, exit 2, within the --timeout (it waited 600 s per read, and exited 141 on the closing
    one); nothing is written."""
    out = tmp_path / "nets.json"
    for behaviour in ("silent", "close"):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        held = []

        def peer():
            c, _ = srv.accept()
            if behaviour == "close":
                c.close()
            else:
                held.append(c)  # accepted, never read from or answered
        threading.Thread(target=peer, daemon=True).start()
        t0 = time.monotonic()
        assert cli.main(["measure", "--networks", "1", "--out", str(out), "--remote", f"127.0.0.1:{port}",
                         "--timeout", "2"]) == 2
        assert time.monotonic() - t0 < 120  # a bound, not a timing: it did not wait out 600 s reads
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"the worker at 127.0.0.1:{port}" in err[0], err
        assert ("did not answer within 2 s" in err[0]) if behaviour == "silent" else "closed" in err[0], err
        assert not out.exists()
        for c in held:
            c.close()
        srv.close()


@pytest.mark.parametrize("argv, message", [
    (["pipeline", "--workdir", "W", "--hosts", "h.yaml", "--secret-file", "missing"], "--secret-file missing: cannot read"),
    (["pipeline", "--workdir", "W", "--secret-file", "s"], "--secret-file and --tls-ca are for --hosts"),
    (["pipeline", "--workdir", "W", "--hosts", "h.yaml", "--tls-ca", "ca.pem"], "TLS needs the shared secret"),
    (["measure", "--networks", "1", "--out", "o.json", "--secret-file", "s"], "are for --remote HOST:PORT"),
    (["measure", "--networks", "1", "--out", "o.json", "--remote", "127.0.0.1:1", "--timeout", "0"],
     "--timeout must be 0-86400 seconds"),
    (["validate", "--table", "t.json", "--networks", "2", "--remote", "127.0.0.1:1", "--secret-file", "short"],
     "a secret must be 16-4096 bytes"),
    (["worker", "--max-sessions", "0"], "--max-sessions must be 1-64"),
    (["worker", "--handshake-timeout", "3600"], "--handshake-timeout must be 0.1-120 seconds"),
    (["worker", "--listen", "127.0.0.1:99999"], "--listen must be HOST:PORT"),
])
def test_the_secret_and_timeout_flags_are_checked_before_any_work(tmp_path, monkeypatch, capsys, argv, message):
    """Each of the flags this issue added: a bad value is one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(auth.ENV, raising=False)
    (tmp_path / "s").write_text(SECRET.decode())
    (tmp_path / "short").write_text("abc")
    (tmp_path / "ca.pem").write_text("not used: refused first")
    (tmp_path / "h.yaml").write_text("ue: 127.0.0.1:1\n")
    before = sorted(os.listdir(tmp_path))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert sorted(os.listdir(tmp_path)) == before


def test_a_session_sends_nothing_to_a_peer_address_that_does_not_prove_the_secret(tmp_path, program):
    """The coordinator's peers message names an address where something that is no worker of this deployment
    answers with a challenge of its own and a wrong proof: the session sends no frame there (the old worker connected
    and sent frames to any HOST:PORT it was told), and reports one error line to its coordinator."""
    proc, port = _daemon(tmp_path)
    rogue, got = L.listen(0), []

    def serve_rogue():
        conn, _ = rogue.accept()
        conn.sendall(auth.server_hello()[0])
        conn.settimeout(10.0)
        data = b""
        try:
            while len(data) < auth.ANSWER and (chunk := conn.recv(auth.ANSWER - len(data))):
                data += chunk
            conn.sendall(secrets.token_bytes(auth.MAC))  # a proof it cannot have: a wrong one
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        got.append(data)
        conn.close()
    t = threading.Thread(target=serve_rogue, daemon=True)
    t.start()
    try:
        conn = auth.secure_client(socket.create_connection(("127.0.0.1", port), timeout=5), auth.Credentials(SECRET))
        manifest, prog, weights = timer.program_part(program)
        manifest["parts"][timer.PART]["to"] = ["elsewhere"]
        L.send_frame(conn, L.JSON, -1, {"part": timer.PART, "manifest": manifest})
        for b in (prog, weights):
            L.send_frame(conn, L.ARRAY, -1, np.frombuffer(b, np.uint8))
        assert "hello" in L.recv_frame(conn).value
        L.send_frame(conn, L.JSON, -1, {"peers": {"elsewhere": ["127.0.0.1", rogue.getsockname()[1]]},
                                        "to": ["elsewhere"], "stretch": 1.0, "out": {"elsewhere": [None, 0.0]},
                                        "in": {}})
        conn.settimeout(90)  # bounds, not timings: a loaded machine starts a session slowly
        msg = L.recv_frame(conn).value
        assert "did not authenticate" in msg["error"] and "\n" not in msg["error"], msg
        t.join(15)
        assert got and L.MAGIC not in got[0] and len(got[0]) <= auth.ANSWER, got
        conn.close()
    finally:
        rogue.close()
        _stop(proc)


def test_one_tls_connection_read_by_one_thread_while_another_writes_carries_every_frame(tmp_path):
    """Both ends of one TLS connection read in one thread while another thread writes (as a session's control
    connection is used: the reader thread and the sends): every frame arrives whole and in order, both ways.
    The connection ``secure_client``/``secure_server`` return (auth.SerialTLS) is non-blocking underneath and
    serialises its TLS calls; this checks that a blocked reader never holds up the writer and that partial
    writes and reads of frames from 4 KB to 84 KB lose nothing."""
    tls = make_tls(tmp_path / "tls")
    server = socket.create_server(("127.0.0.1", 0))
    ends, errors, n = {}, [], 300

    def accept():
        conn, _ = server.accept()
        ends["server"] = auth.secure_server(conn, auth.Credentials(SECRET, tls["cert"], tls["key"], tls["ca"]))

    t = threading.Thread(target=accept)
    t.start()
    ends["client"] = auth.secure_client(socket.create_connection(server.getsockname()), auth.Credentials(SECRET,
                                                                                                         ca=tls["ca"]))
    t.join()
    server.close()
    assert all(isinstance(e, auth.SerialTLS) for e in ends.values())
    got = {"client": [], "server": []}

    def write(side):
        try:
            for i in range(n):
                L.send_frame(ends[side], L.ARRAY, i, np.full(1000 + (i % 7) * 3000, i, np.float32))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    def read(side):
        try:
            for _ in range(n):
                fr = L.recv_frame(ends[side])
                got[side].append((fr.image, bool(np.all(fr.value == fr.image)), fr.value.size))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f, args=(s,), daemon=True) for s in ("client", "server") for f in (read, write)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    for e in ends.values():
        e.close()
    assert not errors, errors
    for side in got:
        assert [g[0] for g in got[side]] == list(range(n)) and all(g[1] for g in got[side])
        assert [g[2] for g in got[side]] == [1000 + (i % 7) * 3000 for i in range(n)]
