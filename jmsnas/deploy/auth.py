"""Who may talk to a worker: a shared secret proved both ways by HMAC challenge-response, and optional TLS.

Every connection of a deployment (a coordinator's control connection to ``jmsnas worker``, a data link between two
devices, the coordinator's camera link, ``jmsnas measure --remote``) begins, when a secret is set, with this
exchange before any frame is read (fixed sizes, ``HANDSHAKE_S`` seconds at most)::

    server -> client   b"JMSA" | version u8 | nonce_s (32 random bytes)
    client -> server   b"JMSA" | version u8 | nonce_c (32) | HMAC-SHA256(secret, b"client" nonce_s nonce_c)
    server -> client   HMAC-SHA256(secret, b"server" nonce_c nonce_s)          (only if the client's MAC is right)

The server speaks first, so a session asked to connect to some address sends nothing to a peer that does not
prove it holds the secret; the MACs are compared with ``hmac.compare_digest``; the secret never crosses the
network. A peer without the secret learns nothing but random nonces and MACs of them.

The secret comes from a file (``--secret-file``; 16 bytes or more, at most 4 KiB, trailing whitespace ignored) or
the environment variable ``JMSNAS_SECRET``; never from a command line, and it is never logged. TLS (``ssl``,
``--tls-cert/--tls-key/--tls-ca``) encrypts what follows: the server presents its certificate, the client checks it
against the CA and the address it connected to; the HMAC exchange runs again inside TLS (``secure_client`` /
``secure_server``) so the encrypted channel is bound to the secret. This module imports only the standard library.
"""
from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import ssl
import threading
import time
from typing import NamedTuple

ENV = "JMSNAS_SECRET"
MAGIC = b"JMSA"
VERSION = 1
NONCE = 32
MAC = 32  # SHA-256
HELLO = len(MAGIC) + 1 + NONCE
ANSWER = HELLO + MAC
HANDSHAKE_S = 10.0  # a peer's first bytes and the whole exchange, in seconds
MIN_SECRET, MAX_SECRET = 16, 4096
MAKE_ONE = ("make one with: head -c 32 /dev/urandom | base64 > ~/.jmsnas_secret && chmod 600 ~/.jmsnas_secret, "
            "copy it to every machine and pass --secret-file ~/.jmsnas_secret (or set JMSNAS_SECRET)")


class AuthError(ConnectionError):
    """A peer that did not prove it holds the secret (or spoke no handshake); one line."""


class Credentials(NamedTuple):
    """What a process proves itself with: the shared secret (bytes; None: no authentication) and TLS files
    (cert/key: what a server presents; ca: what a client checks a server against; all None: no TLS)."""

    secret: bytes | None = None
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None


NONE = Credentials()


def read_secret(path: str | None = None, env: dict | None = None) -> bytes | None:
    """The secret from ``path`` (a file), else ``$JMSNAS_SECRET``, else None; ValueError (one line, never the
    secret itself) when it is unreadable, shorter than 16 bytes or longer than 4 KiB."""
    env = os.environ if env is None else env
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SECRET + 1)
        except OSError as e:
            raise ValueError(f"--secret-file {path}: cannot read it ({e.strerror or e})") from None
        where = f"--secret-file {path}"
    elif env.get(ENV):
        raw, where = env[ENV].encode(), f"${ENV}"
    else:
        return None
    secret = raw.strip()
    if any(not 0x21 <= b <= 0x7e for b in secret):
        raise ValueError(f"{where} must hold printable text without spaces (e.g. base64); {MAKE_ONE}")
    if not MIN_SECRET <= len(secret) <= MAX_SECRET:
        raise ValueError(f"{where} holds {len(secret)} bytes; a secret must be {MIN_SECRET}-{MAX_SECRET} bytes "
                         f"({MAKE_ONE})")
    return secret


def credentials(secret_file=None, tls_cert=None, tls_key=None, tls_ca=None, *, server: bool, env=None
                ) -> Credentials:
    """Credentials from the command-line files (ValueError, one line, on a missing or inconsistent one): a server
    (``jmsnas worker``) with TLS needs --tls-cert and --tls-key (and --tls-ca for its own data links to other
    workers); a client needs --tls-ca. TLS needs a secret too (it binds the channel to it)."""
    secret = read_secret(secret_file, env)
    given = {k: v for k, v in (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--tls-ca", tls_ca)) if v}
    if given:
        need = ("--tls-cert", "--tls-key", "--tls-ca") if server else ("--tls-ca",)
        lacking = [k for k in need if k not in given]
        if lacking:
            raise ValueError(f"TLS needs {' and '.join(need)}; missing {' '.join(lacking)}")
        for flag, path in given.items():
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if secret is None:
            raise ValueError(f"TLS needs the shared secret too (--secret-file or ${ENV}); {MAKE_ONE}")
        creds = Credentials(secret, tls_cert, tls_key, tls_ca)
        try:  # a bad certificate or key is named now, not at the first connection
            if server:
                server_context(creds)
            client_context(creds)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"the TLS files {' '.join(given.values())} cannot be used: "
                             f"{getattr(e, 'reason', None) or e}") from None
        return creds
    return Credentials(secret)


def server_context(creds: Credentials) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(creds.cert, creds.key)
    ctx.num_tickets = 0  # no post-handshake messages: a socket read by one thread and written by another stays safe
    return ctx


def client_context(creds: Credentials) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=creds.ca)
    return ctx


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, "sha256").digest()


def _recv(sock, n: int, deadline: float, what: str) -> bytes:
    """Exactly n bytes before ``deadline`` (time.monotonic); AuthError on silence, EOF or a reset."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"the peer sent no {what} within the handshake time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except (socket.timeout, TimeoutError):
            raise AuthError(f"the peer sent no {what} within the handshake time") from None
        except OSError as e:
            raise AuthError(f"the connection failed during the handshake ({e.strerror or e})") from None
        if not chunk:
            raise AuthError(f"the peer closed the connection instead of sending its {what}")
        buf += chunk
    return bytes(buf)


def _send(sock, data: bytes, deadline: float) -> None:
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except OSError as e:
        raise AuthError(f"the connection failed during the handshake ({e.strerror or e})") from None


def server_hello() -> tuple:
    """(bytes the server sends first, its nonce)."""
    nonce = secrets.token_bytes(NONCE)
    return MAGIC + bytes([VERSION]) + nonce, nonce


def check_answer(secret: bytes, nonce_s: bytes, answer: bytes) -> bytes:
    """The server's proof for the client (``ANSWER`` bytes from it); AuthError when the answer is not a
    handshake or its MAC is wrong."""
    if len(answer) != ANSWER or answer[:4] != MAGIC or answer[4] != VERSION:
        raise AuthError("the peer spoke no jmsnas handshake (an older jmsnas, or not jmsnas)")
    nonce_c, mac = answer[5:5 + NONCE], answer[5 + NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", nonce_s, nonce_c)):
        raise AuthError("the peer does not hold the secret")
    return _mac(secret, b"server", nonce_c, nonce_s)


def server_handshake(sock, secret: bytes, timeout_s: float = HANDSHAKE_S) -> None:
    """The server's side (blocking, at most ``timeout_s``); AuthError if the client does not prove the secret. The
    socket is left blocking without a timeout."""
    deadline = time.monotonic() + timeout_s
    hello, nonce_s = server_hello()
    _send(sock, hello, deadline)
    proof = check_answer(secret, nonce_s, _recv(sock, ANSWER, deadline, "handshake answer"))
    _send(sock, proof, deadline)
    sock.settimeout(None)


def client_handshake(sock, secret: bytes, timeout_s: float = HANDSHAKE_S) -> None:
    """The client's side (at most ``timeout_s``); AuthError if the server does not prove the secret (nothing but
    the nonce and MAC has then been sent to it)."""
    deadline = time.monotonic() + timeout_s
    hello = _recv(sock, HELLO, deadline, "handshake")
    if hello[:4] != MAGIC:
        raise AuthError("the peer spoke no jmsnas handshake (a worker without a secret, or not a jmsnas worker)")
    if hello[4] != VERSION:
        raise AuthError(f"the peer speaks handshake version {hello[4]}, this is version {VERSION}")
    nonce_s, nonce_c = hello[5:], secrets.token_bytes(NONCE)
    _send(sock, MAGIC + bytes([VERSION]) + nonce_c + _mac(secret, b"client", nonce_s, nonce_c), deadline)
    proof = _recv(sock, MAC, deadline, "proof of the secret")
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthError("the peer does not hold the secret")
    sock.settimeout(None)


def secure_client(sock, creds: Credentials, host: str | None = None, timeout_s: float = HANDSHAKE_S):
    """The client end of a new connection made ready: the handshake, then TLS (the server's certificate checked
    against the CA and ``host``) and the handshake again inside it. Returns the socket to use (an SSLSocket with
    TLS); AuthError / ssl.SSLError otherwise. Without a secret: the socket as it is."""
    if creds.secret is None:
        return sock
    client_handshake(sock, creds.secret, timeout_s)
    if not creds.tls:
        return sock
    sock.settimeout(timeout_s)
    tls = client_context(creds).wrap_socket(sock, server_hostname=host or sock.getpeername()[0])
    client_handshake(tls, creds.secret, timeout_s)
    return SerialTLS(tls)


def secure_server(sock, creds: Credentials, timeout_s: float = HANDSHAKE_S, *, authenticated: bool = False):
    """The server end of an accepted connection made ready (``authenticated``: the plain handshake was done
    already, by the ``jmsnas worker`` that handed this session its connection). See ``secure_client``."""
    if creds.secret is None:
        return sock
    if not authenticated:
        server_handshake(sock, creds.secret, timeout_s)
    if not creds.tls:
        return sock
    sock.settimeout(timeout_s)
    tls = server_context(creds).wrap_socket(sock, server_side=True)
    server_handshake(tls, creds.secret, timeout_s)
    return SerialTLS(tls)


class SerialTLS:
    """A TLS connection that one thread may read while another writes (a session's control connection: the
    coordinator's reader thread and its sends; a worker's watch thread and its replies).

    OpenSSL allows no two calls on one connection at once; two threads blocked in ``SSL_read`` and ``SSL_write``
    of one ``ssl.SSLSocket`` corrupted its state under load (a session died without a word). So the TLS socket is
    non-blocking and every TLS call holds one lock, taken only for a call that cannot block: a reader with nothing
    to read waits for the raw socket's bytes (``select``, no TLS call) outside the lock, a writer whose kernel
    buffer is full waits likewise, so neither holds up the other. Blocking and timeout behave as a socket's:
    ``settimeout(None)`` blocks, ``0`` raises ``ssl.SSLWantReadError`` / ``SSLWantWriteError`` at once, a number of
    seconds raises ``TimeoutError``."""

    def __init__(self, tls: ssl.SSLSocket):
        self.tls, self.lock, self.timeout = tls, threading.Lock(), tls.gettimeout()
        tls.setblocking(False)

    def _call(self, op):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            with self.lock:
                try:
                    return op()
                except ssl.SSLWantReadError:
                    want_read = True
                except ssl.SSLWantWriteError:
                    want_read = False
            if self.timeout == 0:
                raise ssl.SSLWantReadError() if want_read else ssl.SSLWantWriteError()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("timed out")
            r, w, _ = select.select([self.tls] if want_read else [], [] if want_read else [self.tls], [], left)
            if not (r or w) and left is not None:
                raise TimeoutError("timed out")

    def recv(self, n: int) -> bytes:
        return self._call(lambda: self.tls.recv(n))

    def recv_into(self, buf, n: int = 0) -> int:
        return self._call(lambda: self.tls.recv_into(buf, n))

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            view = view[self._call(lambda: self.tls.send(view)):]

    def send(self, data) -> int:
        return self._call(lambda: self.tls.send(data))

    def pending(self) -> int:
        with self.lock:
            return self.tls.pending()

    def settimeout(self, t) -> None:
        self.timeout = t

    def gettimeout(self):
        return self.timeout

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def close(self) -> None:
        with self.lock:
            self.tls.close()

    def __getattr__(self, name):  # fileno, getpeername, getsockopt, setsockopt, shutdown, family ...
        return getattr(self.tls, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_no_secret_needed(sock, wait_s: float = 0.3) -> None:
    """For a client without a secret on a fresh control connection: AuthError when the server opened with a
    handshake (it requires the secret), looked for during ``wait_s`` without consuming anything."""
    if demands_secret(sock, wait_s):
        raise AuthError("the worker requires a shared secret and none was given")


def demands_secret(sock, wait_s: float = 0.3) -> bool:
    """True when the server at the other end of a fresh connection opened with a handshake (it requires a secret
    this client was not given); looked for during ``wait_s`` without consuming anything."""
    sock.settimeout(wait_s)
    try:
        first = sock.recv(len(MAGIC), socket.MSG_PEEK)
    except OSError:  # timeout: the server waits for the client, as one without a secret does
        first = b""
    sock.settimeout(None)
    return first == MAGIC


def to_env(creds: Credentials, env: dict) -> dict:
    """``env`` for a child process that inherits these credentials: the secret in ``JMSNAS_SECRET`` (an
    environment is readable only by its user, unlike a command line), the TLS files as JMSNAS_TLS_CERT/KEY/CA."""
    out = {k: v for k, v in env.items() if k not in (ENV, "JMSNAS_TLS_CERT", "JMSNAS_TLS_KEY", "JMSNAS_TLS_CA")}
    if creds.secret is not None:
        out[ENV] = creds.secret.decode("ascii")
    for name, v in (("CERT", creds.cert), ("KEY", creds.key), ("CA", creds.ca)):
        if v is not None:
            out[f"JMSNAS_TLS_{name}"] = v
    return out


def from_env(env: dict | None = None) -> Credentials:
    """The credentials ``to_env`` handed this process."""
    env = os.environ if env is None else env
    secret = env.get(ENV)
    return Credentials(secret.encode("ascii") if secret else None, env.get("JMSNAS_TLS_CERT"),
                       env.get("JMSNAS_TLS_KEY"), env.get("JMSNAS_TLS_CA"))


def generated() -> Credentials:
    """A fresh random secret (a local pipeline's processes share one: their data ports on 127.0.0.1 let in none
    but each other)."""
    return Credentials(secrets.token_hex(32).encode())
