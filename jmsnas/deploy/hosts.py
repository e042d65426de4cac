"""The hosts file of ``jmsnas pipeline --hosts FILE``: where each device's ``jmsnas worker --listen`` runs.

YAML or JSON (by extension), a mapping device -> "HOST:PORT" (or [host, port]), naming exactly the export's
devices::

    ue: 10.0.0.1:7000
    sbs: 10.0.0.2:7000
    cloud: gpu-box.example.org:7000
"""
from __future__ import annotations

from jmsnas import safeio
from jmsnas.deploy.runtime import DeployError

MAX_BYTES = 1 << 16  # a hosts file names a few devices: 64 KiB is far beyond any real one
MAX_DEPTH = 4


def read_hosts(path: str) -> dict:
    """The parsed mapping of a hosts file, read with the capped parsers of topology files (``safeio.load_yaml`` /
    ``load_json``: size, nesting, aliases, a key defined twice); DeployError (one line): unreadable, larger than
    ``MAX_BYTES`` (read no further, so /dev/zero is refused too), not YAML/JSON, not a mapping."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise DeployError(f"cannot read the hosts file {path}: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise DeployError(f"the hosts file {path} is larger than {MAX_BYTES} bytes; a hosts file names a few devices")
    try:
        load = safeio.load_json if path.lower().endswith(".json") else safeio.load_yaml
        obj = load(data, f"the hosts file {path}", max_bytes=MAX_BYTES, max_depth=MAX_DEPTH)
    except ValueError as e:
        raise DeployError(" ".join(str(e).split())) from None
    if not isinstance(obj, dict):
        raise DeployError(f"the hosts file {path} must be a mapping device -> HOST:PORT, got {type(obj).__name__}")
    return obj


def check_hosts(hosts, order: list, source: str = "the hosts") -> dict:
    """{device: (host, port)} for every device of ``order`` from {device: "HOST:PORT" or [host, port]};
    DeployError naming the bad or missing entry."""
    if not isinstance(hosts, dict):
        raise DeployError(f"{source} must map every device to HOST:PORT, got {type(hosts).__name__}")
    unknown, missing = sorted(set(hosts) - set(order)), [d for d in order if d not in hosts]
    if unknown or missing:
        raise DeployError(f"{source} must name exactly the devices {order}; "
                          + (f"unknown {unknown}" if unknown else f"missing {missing}"))
    out = {}
    for d in order:
        v = hosts[d]
        host, _, port = (v.rpartition(":") if isinstance(v, str) else
                         (v[0], ":", v[1]) if isinstance(v, (list, tuple)) and len(v) == 2 else ("", "", ""))
        port = str(port) if isinstance(port, (int, str)) and not isinstance(port, bool) else ""
        if not host or not isinstance(host, str) or not port.isdigit() or not 0 < int(port) <= 65535:
            raise DeployError(f"{source}: device {d!r} must be HOST:PORT with a port 1-65535, got "
                              f"{safeio.short(v, 80)}")  # short: never the whole of an alias-expanded value
        out[d] = (host.strip("[]"), int(port))
    return out
