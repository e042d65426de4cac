"""Timing exported programs on another machine: ``jmsnas worker --listen HOST:PORT`` there (the pipeline's own
worker, ``jmsnas.deploy.daemon``), and ``time_programs("HOST:PORT", programs)`` here (``jmsnas measure --remote``).

There is one server: every program is sent to the worker as a part of its own (the control protocol of
``jmsnas.deploy.worker``: ``{"part", "manifest"}`` with the program's bytes and its weights file, empty when the
weights are constants; the worker checks them as it checks any part: SHA-256, signature, versions, platform) and
the next program replaces it in the same session; ``{"end": true}`` closes the session. ``time_programs`` times
each with ``{"calibrate": R, "warmup": W}`` (after a first call that compiles it and W more, R timed calls on zeros
of its input shapes); ``probe_deployed`` (``jmsnas profile --remote``) with the ``run`` probe (the part called
right after its input arrives there) and the ``echo`` probe (a frame's round trip).
"""
from __future__ import annotations

import hashlib
import io
import socket

import ssl

import numpy as np

from jmsnas.deploy import auth, links as L
from jmsnas.deploy.daemon import parse_address as _parse

PART = "program"  # the device name every timed program plays


def parse_address(text: str) -> tuple:
    """(host, port) from 'HOST:PORT'; ValueError naming the text otherwise."""
    return _parse(text, "remote address")


def program_part(blob: bytes, weights: dict | None = None) -> tuple:
    """(manifest, program bytes, weights bytes): a serialised ``jax.export`` program (one output) as a one-part
    export the worker loads (``runtime.load_part``); ``weights`` {name: array}: its leading arguments, in sorted name
    order (as ``export.program_with_weights`` makes them and a deployed part is called), None: weights folded in as
    constants."""
    from jax import export

    from jmsnas.deploy.runtime import FORMAT, export_versions
    try:
        prog = export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001 - flatbuffer errors have no common type
        raise ValueError(f"not a serialised jax.export program: {type(e).__name__}: {str(e)[:200]}") from None
    if len(prog.out_avals) != 1:
        raise ValueError(f"a timed program must return one array, this one returns {len(prog.out_avals)}")
    weights = weights or {}
    names = sorted(weights)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(weights[k]) for k in names})
    wbytes = buf.getvalue()
    aval = lambda a: {"shape": [int(d) for d in a.shape], "dtype": str(np.dtype(a.dtype))}
    entry = {"device": PART, "program": f"{PART}.jaxexport", "program_sha256": hashlib.sha256(blob).hexdigest(),
             "weights": f"{PART}.npz", "weights_sha256": hashlib.sha256(wbytes).hexdigest(), "weight_names": names,
             "inputs": [dict(aval(a), **{"from": "image"}) for a in prog.in_avals[len(names):]],
             "output": aval(prog.out_avals[0]), "to": ["result"]}
    manifest = {"format": FORMAT, "run": "RUN", "platforms": list(prog.platforms), "batch": 1,
                "versions": export_versions(int(prog.calling_convention_version)), "kind": "chain",
                "order": [PART], "links": [], "parts": {PART: entry}}
    return manifest, bytes(blob), wbytes


def _reply(conn, address: str, key: str, timeout_s: float) -> dict:
    conn.settimeout(timeout_s)
    try:
        fr = L.recv_frame(conn)
    except (socket.timeout, TimeoutError):
        raise ValueError(f"the worker at {address} did not answer within {timeout_s:g} s") from None
    except (L.LinkClosed, OSError) as e:
        raise ValueError(f"the worker at {address} closed the session: {e}") from None
    msg = fr.value if fr.kind == L.JSON and isinstance(fr.value, dict) else {}
    if "error" in msg:
        raise ValueError(f"the worker at {address} failed: {msg['error']}")
    if key not in msg:
        raise ValueError(f"the worker at {address} answered without {key!r}")
    return msg


CONNECT_S = 10.0  # seconds to reach the worker


def _check_timeout(timeout_s: float) -> None:
    if not 0 < timeout_s <= 86400:
        raise ValueError(f"the timeout must be 0-86400 s, got {timeout_s!r}")


def _open(address: str, credentials: auth.Credentials | None):
    """A control connection to the worker at ``address`` that has proved the secret (``credentials``, default
    $JMSNAS_SECRET: nothing is sent to a worker that does not); ValueError naming the address otherwise."""
    host, port = parse_address(address)
    creds = credentials if credentials is not None else auth.Credentials(auth.read_secret())
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a probe's two frames leave at once
    except OSError as e:
        raise ValueError(f"cannot reach the worker at {address}: {e.strerror or e} (start one there with: jmsnas "
                         f"worker --listen {host}:{port})") from None
    try:
        if creds.secret is None:
            auth.check_no_secret_needed(conn)
        return auth.secure_client(conn, creds, host)
    except (auth.AuthError, ssl.SSLError, OSError) as e:
        conn.close()
        hint = " (give it with --secret-file or $JMSNAS_SECRET)" if creds.secret is None else ""
        raise ValueError(f"the worker at {address} did not authenticate: {' '.join(str(e).split())}{hint}") from None


def _session(address: str, credentials, timeout_s: float, work):
    """``work(conn)`` over one authenticated session with the worker at ``address``, then ``{"end": true}``;
    its return value. A timeout or a closed connection is one ValueError line naming the address."""
    conn = _open(address, credentials)
    with conn:
        try:
            conn.settimeout(timeout_s)
            out = work(conn)
            L.send_frame(conn, L.JSON, -1, {"end": True})
        except (socket.timeout, TimeoutError):
            raise ValueError(f"the worker at {address} did not answer within {timeout_s:g} s (it took no data)") from None
        except OSError as e:  # a reset or broken pipe: the peer closed
            raise ValueError(f"the worker at {address} closed the connection: {e.strerror or e}") from None
    return out


def _load(conn, address: str, part: tuple, timeout_s: float) -> None:
    """Sends one ``program_part`` to the worker (replacing the one it holds) and waits for its hello."""
    manifest, prog, weights = part
    L.send_frame(conn, L.JSON, -1, {"part": PART, "manifest": manifest})
    for blob in (prog, weights):
        L.send_frame(conn, L.ARRAY, -1, np.frombuffer(blob, np.uint8))
    _reply(conn, address, "hello", timeout_s)


def time_programs(address: str, programs, *, reps: int = 20, warmup: int = 2, timeout_s: float = 60.0,
                  credentials: auth.Credentials | None = None) -> list:
    """Median ms of each serialised program (bytes) on the ``jmsnas worker`` at ``address`` (one session for all);
    ValueError (one line naming the address) when the worker cannot be reached, does not prove the secret
    (``credentials``, default $JMSNAS_SECRET: nothing is sent to it then), closes the connection, reports an error
    or leaves a reply out for ``timeout_s`` seconds (a program's compilation and its timed calls included)."""
    parse_address(address)
    if not 1 <= reps <= 10000 or not 0 <= warmup <= 1000:
        raise ValueError(f"reps must be 1-10000 and warmup 0-1000, got {reps}, {warmup}")
    _check_timeout(timeout_s)
    parts = [program_part(b) for b in programs]

    def work(conn):
        out = []
        for part in parts:
            _load(conn, address, part, timeout_s)
            L.send_frame(conn, L.JSON, -1, {"calibrate": reps, "warmup": warmup})
            out.append(float(np.median(_reply(conn, address, "times_ms", timeout_s)["times_ms"])))
        return out
    return _session(address, credentials, timeout_s, work)


def probe_deployed(address: str, parts, sizes, *, reps: int = 30, seed: int = 0, timeout_s: float = 60.0,
                   credentials: auth.Credentials | None = None, wholes=()) -> tuple:
    """The deployed terms' raw timings on the ``jmsnas worker`` at ``address`` (one session; the worker's
    ``run`` and ``echo`` probes): ``parts`` [(program_part tuple, its first input array)], each loaded in turn and
    called ``reps`` times right after its input arrives there (after one untimed call); then frames of each of
    ``sizes`` bytes sent to it and answered, in ``reps`` shuffled rounds after a warm-up round; then every
    program_part of ``wholes`` timed by ``reps`` back-to-back calls (``calibrate``, after one untimed). Returns
    (run ms [parts][reps] on the worker's clock, round-trip ms {bytes: [reps]} on this one, whole ms
    [wholes][reps]). Errors as ``time_programs``."""
    parse_address(address)
    if not 1 <= reps <= 10000:
        raise ValueError(f"reps must be 1-10000, got {reps}")
    _check_timeout(timeout_s)
    sizes = [int(n) for n in sizes]

    def work(conn):
        runs = []
        for part, x in parts:
            _load(conn, address, part, timeout_s)
            times = []
            for r in range(reps + 1):
                L.send_frame(conn, L.JSON, -1, {"run": True})
                L.send_frame(conn, L.ARRAY, -1, x)
                ms = float(_reply(conn, address, "run_ms", timeout_s)["run_ms"])
                if r:
                    times.append(ms)
            runs.append(times)
        rtt, rng = {n: [] for n in sizes}, np.random.default_rng([seed, 4])
        for r in range(reps + 1):
            for j in rng.permutation(len(sizes)):
                n = sizes[j]
                payload = np.zeros(n, np.uint8)
                t0 = L.now()
                L.send_frame(conn, L.JSON, -1, {"echo": True})
                L.send_frame(conn, L.ARRAY, -1, payload)
                got = _reply(conn, address, "echo", timeout_s)["echo"]
                t1 = L.now()
                if got != n:
                    raise ValueError(f"the worker at {address} echoed {got!r} bytes of a {n}-byte frame")
                if r:
                    rtt[n].append((t1 - t0) * 1e3)
        whole = []
        for part in wholes:
            _load(conn, address, part, timeout_s)
            L.send_frame(conn, L.JSON, -1, {"calibrate": reps, "warmup": 1})
            whole.append([float(t) for t in _reply(conn, address, "times_ms", timeout_s)["times_ms"]])
        return runs, rtt, whole
    return _session(address, credentials, timeout_s, work)
