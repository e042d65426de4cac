"""``jmsnas worker --listen HOST:PORT``: the long-running process on a machine that plays a device of a pipeline.

It imports only the standard library, ``links`` and ``auth``. It listens on HOST:PORT (default 127.0.0.1:7000;
an address other machines can reach needs a shared secret); every connection a coordinator makes (``jmsnas
pipeline --hosts FILE``, ``jmsnas measure --remote``, or anything speaking the control protocol of
``jmsnas.deploy.worker``) that proves it holds the secret (``jmsnas.deploy.auth``: HMAC challenge-response, within
``auth.HANDSHAKE_S`` seconds) becomes one session: a child process ``python -m jmsnas.deploy.worker --fd N`` that
receives the accepted socket, the part's files over it and plays that device until the coordinator stops it or goes
away. Without a secret (loopback only) a session starts once the peer has sent its first bytes, within the same
time. Nothing is read from a peer before that, and a peer bounds nothing but its own connection: one thread
handles every connection still in its handshake (at most ``MAX_PENDING``; the oldest is dropped for a new one, and
for the descriptors when the process runs out of them), at most ``max_sessions`` sessions run at once (a coordinator
beyond them is told so in one line). Every refused peer is one line on stderr. Sessions end with their control
connection and die with this process; SIGTERM/SIGINT end this process after its sessions.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time

from jmsnas.deploy import auth, links as L

MAX_PENDING = 128  # connections in their handshake at once
MAX_SESSIONS = 4  # session processes at once (each loads jax: ~170 MiB)
DEFAULT_LISTEN = "127.0.0.1:7000"


def parse_address(text: str, what: str = "address") -> tuple:
    """(host, port) from 'HOST:PORT' (port 0-65535); ValueError naming the text otherwise."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port 0-65535, got {text!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _log(line: str) -> None:
    print(f"jmsnas worker: {line}", file=sys.stderr, flush=True)


class _Pending:
    """A connection in its handshake: the bytes it sent so far, the nonce sent to it, its deadline."""

    def __init__(self, conn, peer, nonce, deadline):
        self.conn, self.peer, self.nonce, self.deadline, self.buf = conn, peer, nonce, deadline, b""


def serve(host: str, port: int, *, announce=print, sessions: int | None = None, creds: auth.Credentials = auth.NONE,
          max_sessions: int = MAX_SESSIONS, max_pending: int = MAX_PENDING, handshake_s: float = auth.HANDSHAKE_S
          ) -> int:
    """Accepts coordinators on host:port and starts a session per authenticated connection; returns an exit code
    (2: cannot listen). ``sessions``: stop after that many sessions started (None: run until signalled)."""
    try:
        server = L.listen(port, host)
    except OSError as e:
        why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        print(f"jmsnas worker: error: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        return 2
    server.listen(128)
    server.setblocking(False)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:  # leave descriptors for the sessions' pipes and sockets
        max_pending = max(4, min(max_pending, (soft - 24) // 2))
    children: list = []
    pending: dict = {}  # fileno -> _Pending
    draining: dict = {}  # fileno -> _Pending: refused after the handshake, read and dropped until it closes
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    env = auth.to_env(creds, os.environ)

    def drop(p: _Pending, why: str | None = None) -> None:
        pending.pop(p.conn.fileno(), None)
        try:
            sel.unregister(p.conn)
        except (KeyError, ValueError):
            pass
        p.conn.close()
        if why:
            _log(f"refused {p.peer}: {why}")

    def drain_end(q: _Pending) -> None:
        draining.pop(q.conn.fileno(), None)
        sel.unregister(q.conn)
        q.conn.close()

    def start(p: _Pending) -> None:
        pending.pop(p.conn.fileno(), None)
        sel.unregister(p.conn)
        conn = p.conn
        try:
            conn.setblocking(True)
            children[:] = [c for c in children if c.poll() is None]
            if len(children) >= max_sessions:
                conn.settimeout(2.0)
                L.send_frame(conn, L.JSON, value={"error": f"the jmsnas worker at {host}:{port} is busy: "
                                                           f"{len(children)} sessions run (at most {max_sessions})",
                                                  "cause": "own"})
                _log(f"refused {p.peer}: {len(children)} sessions run already (at most {max_sessions})")
                conn.shutdown(socket.SHUT_WR)  # read what it still sends for a while, so the answer is not reset
                conn.setblocking(False)
                draining[conn.fileno()] = q = _Pending(conn, p.peer, None, time.monotonic() + 5.0)
                sel.register(conn, selectors.EVENT_READ, q)
                conn = None
                return
            cmd = [sys.executable, "-m", "jmsnas.deploy.worker", "--fd", str(conn.fileno())]
            children.append(subprocess.Popen(cmd, pass_fds=(conn.fileno(),), stdin=subprocess.DEVNULL, env=env))
        except OSError as e:
            _log(f"could not start a session for {p.peer}: {e.strerror or e}")
        finally:
            if conn is not None:
                conn.close()

    def on_accept() -> None:
        for _ in range(64):  # a burst at a time, then the pending connections get their turn
            try:
                conn, addr = server.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if pending:  # out of descriptors: the oldest handshake gives its own back
                        drop(min(pending.values(), key=lambda q: q.deadline))
                    else:
                        time.sleep(0.05)
                    return
                continue  # ECONNABORTED and the like: that peer is gone
            if len(pending) >= max_pending:
                drop(min(pending.values(), key=lambda q: q.deadline))
            conn.setblocking(False)
            nonce = None
            if creds.secret is not None:
                hello, nonce = auth.server_hello()
                try:
                    conn.send(hello)  # 37 bytes into an empty send buffer
                except OSError:
                    conn.close()
                    continue
            p = _Pending(conn, f"{addr[0]}:{addr[1]}", nonce, time.monotonic() + handshake_s)
            pending[conn.fileno()] = p
            sel.register(conn, selectors.EVENT_READ, p)

    def on_read(p: _Pending) -> bool:
        """True when ``p`` became a session."""
        try:
            if creds.secret is None:
                if not p.conn.recv(1, socket.MSG_PEEK):
                    drop(p)  # closed before a word: no session
                    return False
                start(p)
                return True
            data = p.conn.recv(auth.ANSWER - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            drop(p)
            return False
        if not data:
            drop(p)
            return False
        p.buf += data
        if len(p.buf) < auth.ANSWER:
            return False
        try:
            proof = auth.check_answer(creds.secret, p.nonce, p.buf)
            p.conn.settimeout(2.0)
            p.conn.sendall(proof)
        except auth.AuthError as e:
            drop(p, str(e))
            return False
        except OSError:
            drop(p)
            return False
        start(p)
        return True

    def stop(signum, _frame):
        for c in list(children):
            if c.poll() is None:
                c.terminate()
        for c in list(children):
            try:
                c.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                c.kill()
        server.close()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    announce(f"jmsnas worker listening on {host}:{server.getsockname()[1]} (pid {os.getpid()}"
             f"{', secret required' if creds.secret is not None else ''}{', TLS' if creds.tls else ''})")
    started = 0
    while sessions is None or started < sessions:
        for key, _ in sel.select(timeout=0.2):  # wake up to reap ended sessions, so none lingers as a zombie
            if key.fileobj is server:
                on_accept()
            elif pending.get(key.fd) is key.data:
                started += on_read(key.data)
            elif draining.get(key.fd) is key.data:
                try:
                    more = key.data.conn.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    more = b""
                if not more:
                    drain_end(key.data)
        now = time.monotonic()
        for q in [q for q in draining.values() if q.deadline < now]:
            drain_end(q)
        for p in [q for q in pending.values() if q.deadline < now]:
            drop(p)  # silent past the handshake time: closed, nothing logged (a port scan is no event)
        children[:] = [c for c in children if c.poll() is None]
    for p in list(pending.values()):
        drop(p)
    for q in list(draining.values()):
        drain_end(q)
    for c in list(children):
        c.wait()
    sel.close()
    server.close()
    return 0


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="jmsnas worker", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p) -> None:
    """The flags of ``jmsnas worker`` (also ``jmsnas.commands.deploy``)."""
    p.add_argument("--listen", default=DEFAULT_LISTEN,
                   help=f"HOST:PORT or PORT to accept coordinators on (default {DEFAULT_LISTEN}; an address other "
                        "machines reach, such as 0.0.0.0:7000, needs --secret-file)")
    add_secret_arguments(p, server=True)
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help=f"sessions (processes) at once, 1-64 (default {MAX_SESSIONS})")
    p.add_argument("--handshake-timeout", type=float, default=auth.HANDSHAKE_S,
                   help=f"seconds a peer has for its first bytes and the whole handshake, 0.1-120 (default "
                        f"{auth.HANDSHAKE_S:g})")


def add_secret_arguments(p, server: bool = False) -> None:
    """--secret-file and the TLS files, for the worker (``server``) and the commands that connect to one."""
    p.add_argument("--secret-file", default=None,
                   help=f"a file holding the shared secret (16+ printable bytes; default ${auth.ENV}); peers prove "
                        "they hold it before anything is read or sent")
    p.add_argument("--tls-ca", default=None, help="TLS: the CA certificate the workers' certificates are checked "
                                                  "against (encrypts every link; needs the secret)")
    if server:
        p.add_argument("--tls-cert", default=None, help="TLS: this worker's certificate (PEM)")
        p.add_argument("--tls-key", default=None, help="TLS: this worker's private key (PEM)")


def client_credentials(args) -> auth.Credentials:
    """The credentials of a command that connects to workers (ValueError: one line)."""
    return auth.credentials(args.secret_file, None, None, args.tls_ca, server=False)


def run(args) -> int:
    """``jmsnas worker``: every flag checked (one line, exit 2) before anything listens."""
    try:
        text = args.listen.strip()
        host, port = ("127.0.0.1", int(text)) if text.isdigit() else parse_address(text, "--listen")
        if not 0 <= port <= 65535:
            raise ValueError(f"--listen must be HOST:PORT or PORT with a port 0-65535, got {args.listen!r}")
        if not 1 <= args.max_sessions <= 64:
            raise ValueError(f"--max-sessions must be 1-64, got {args.max_sessions}")
        if not 0.1 <= args.handshake_timeout <= 120:
            raise ValueError(f"--handshake-timeout must be 0.1-120 seconds, got {args.handshake_timeout!r}")
        creds = auth.credentials(args.secret_file, args.tls_cert, args.tls_key, args.tls_ca, server=True)
        if creds.secret is None and not is_loopback(host):
            raise ValueError(f"--listen {args.listen} can be reached from other machines and the worker runs any "
                             f"program sent to it; it needs a shared secret: {auth.MAKE_ONE}")
    except ValueError as e:
        print(f"jmsnas worker: error: {e}", file=sys.stderr)
        return 2
    return serve(host, port, announce=lambda s: print(s, flush=True), creds=creds, max_sessions=args.max_sessions,
                 handshake_s=args.handshake_timeout)


if __name__ == "__main__":
    sys.exit(main())
