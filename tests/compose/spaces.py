"""Tiny composed spaces for the oracle tests, and an independent per-configuration reference of their costs.

The reference evaluates every configuration directly from its definition (vectorised over configurations with
numpy, float64): it shares only the per-choice ``Terms`` with the library (whose entries ``test_terms`` checks by
hand), not the closed-form sums, maxima and expectations under test."""
import itertools

import jax.numpy as jnp
import numpy as np

from jmsnas.compose import choices as C
from jmsnas.compose import terms as TT
from jmsnas.cost import energy as CE
from jmsnas.cost import memory as CM
from jmsnas.cost.latency import mesh_segments
from jmsnas.cost.tables import analytic_table
from jmsnas.space import build_space
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology


def chain_space(lpd=(2, 1)):
    devs = [DeviceProfile("ue", 2.0, 1e9, mem_bandwidth_gbs=0.1, active_power_w=2.0),
            DeviceProfile("cloud", 50.0, 1e9, active_power_w=30.0)]
    topo = make_topology("c", devs, [LinkProfile("ue", "cloud", 5.0, 0.5, True, 3.0, 0.5)], lpd)
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12),
                       device_strides=(1, 1), stem_channels=8, head_channels=8)


def mesh_space():
    names = ["root", "b0", "b1", "agg"]
    devs = [DeviceProfile(n, p, 1e9, mem_bandwidth_gbs=bw, active_power_w=w)
            for n, p, bw, w in zip(names, (2.0, 5.0, 4.0, 50.0), (0.5, 1.0, 1.0, 20.0), (1.0, 2.0, 1.5, 20.0))]
    links = [LinkProfile(a, b, bw, 0.2, False, 1.0, 0.5) for (a, b), bw in
             zip([("root", "b0"), ("root", "b1"), ("b0", "agg"), ("b1", "agg")], (4.0, 6.0, 3.0, 8.0))]
    topo = make_topology("m", devs, links, (1, 1, 1, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12, 12, 12),
                       device_strides=(1, 1, 1, 1), stem_channels=8, head_channels=8)


def mesh_ends_space():
    """p0 -> root -> b0, b1 -> agg -> q0, one layer each: the chains before the fork and after the merge re-split
    under a searched split (root and agg may relay)."""
    names = ["p0", "root", "b0", "b1", "agg", "q0"]
    devs = [DeviceProfile(n, p, 1e9, mem_bandwidth_gbs=bw, active_power_w=w) for n, p, bw, w in
            zip(names, (1.0, 2.0, 5.0, 4.0, 50.0, 30.0), (0.3, 0.5, 1.0, 1.0, 20.0, 10.0), (1.0, 1.0, 2.0, 1.5, 20.0, 9.0))]
    pairs = [("p0", "root"), ("root", "b0"), ("root", "b1"), ("b0", "agg"), ("b1", "agg"), ("agg", "q0")]
    links = [LinkProfile(a, b, bw, 0.2, False, 1.0, 0.5) for (a, b), bw in zip(pairs, (2.0, 4.0, 6.0, 3.0, 8.0, 5.0))]
    topo = make_topology("me", devs, links, (1,) * 6)
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12, 12, 12, 16, 16),
                       device_strides=(1,) * 6, stem_channels=8, head_channels=8)


def with_deployed_terms(table, space):
    """``table`` with a deployed part's call cost on every device and a hand-off a + b * bytes on every link (ms)."""
    m, l = space.topology.num_devices, len(space.topology.links)
    return table._replace(call_ms=jnp.linspace(0.05, 0.2, m, dtype=jnp.float32),
                          handoff_ms=jnp.full((l,), 0.03, jnp.float32),
                          handoff_ms_per_byte=jnp.full((l,), 2e-6, jnp.float32))


def setup(space, modules=(2,), weight_bits=(4, 32), act_bits=(8, 32), quantize=None, deployed=False,
          module_optional=True, send_input=False):
    table = analytic_table(space)
    table = with_deployed_terms(table, space) if deployed else table
    ch = C.make_choices(space.topology, modules, weight_bits, act_bits, quantize, module_optional, send_input)
    return table, ch, TT.build_terms(space, table, ch), CM.space_memory(space)


def configs(supports):
    """int[C, G] of every combination of the per-group supports (a list of index lists)."""
    return np.array(list(itertools.product(*supports)), np.int64).reshape(-1, len(supports))


def split_of(space, a):
    """(layer devices int[N], the stem's device) of an assignment of N or N + 1 entries (the stem's last)."""
    a, n = np.asarray(a), space.num_layers
    return (a[:n], int(a[n])) if len(a) == n + 1 else (a, space.topology.path_order()[0])


def boundaries(space, a):
    """Boundary j of every link under assignment ``a`` (an independent count): a chain's link before the stem's
    device carries the input (N + 1), any other the output of the last layer done before it (0: the stem's)."""
    topo = space.topology
    a, stem = split_of(space, a)
    out = np.zeros(len(topo.links), np.int64)
    if topo.kind == "chain":
        order = list(topo.pre)
        for p in range(len(order) - 1):
            done = sum(order.index(d) <= p for d in a)
            out[topo.link_index(order[p], order[p + 1])] = space.num_layers + 1 if order.index(stem) > p else done
        return out
    seg = mesh_segments(space)
    before = list(topo.pre) + [topo.root]
    for p in range(len(before) - 1):  # the chain before the fork: the layers done on its devices so far
        out[topo.link_index(before[p], before[p + 1])] = sum(d in before[:p + 1] for d in a)
    for q in range(len(topo.post) - 1):  # after the merge: past the last layer done there so far (none: the merge)
        out[topo.link_index(topo.post[q], topo.post[q + 1])] = max([n for n in range(space.num_layers)
                                                                    if a[n] in topo.post[:q + 1]],
                                                                   default=seg.suffix_start - 1) + 1
    for b in topo.branches:
        out[topo.link_index(topo.root, b)] = seg.prefix
        out[topo.link_index(b, topo.post[0])] = max(n for n in range(space.num_layers) if a[n] == b) + 1
    return out


def reference(space, table, terms, mem, ops, wb, mod, ab, a):
    """Per configuration (rows of ops/wb [C, N], mod/ab [C, L]) under assignment ``a``: a dict of float64 arrays
    T [C], per_device ms [C, M], per_link ms [C, L], memory [C, M], energy [C, M]."""
    topo = space.topology
    f = lambda x: np.asarray(x, np.float64)
    lm, wbytes, send, recv = f(terms.layer_ms), f(terms.weight_bytes), f(terms.send_ms), f(terms.recv_ms)
    wire = f(terms.wire_bytes)
    c, m = len(ops), topo.num_devices
    j = boundaries(space, a)
    a, stem = split_of(space, a)
    order = topo.path_order()
    dev_ms, weights = np.zeros((c, m)), np.zeros((c, m))
    buffers = np.zeros((c, m))
    acts = np.zeros((c, m))
    for n in range(space.num_layers):
        dev_ms[:, a[n]] += lm[a[n], n, ops[:, n], wb[:, n]]
        weights[:, a[n]] += wbytes[a[n], n, ops[:, n], wb[:, n]]
        acts[:, a[n]] = np.maximum(acts[:, a[n]], f(mem.act_bytes)[n, ops[:, n]])
    dev_ms[:, stem] += float(table.stem_ms[stem])
    dev_ms[:, order[-1]] += float(table.head_ms[order[-1]])
    dev_ms += np.broadcast_to(np.asarray(table.call_ms, np.float64), (m,))  # every part's call cost (0: none)
    weights[:, stem] += float(mem.stem_weight_bytes)
    weights[:, order[-1]] += float(mem.head_weight_bytes)
    acts[:, stem] = np.maximum(acts[:, stem], float(mem.stem_act_bytes))
    acts[:, order[-1]] = np.maximum(acts[:, order[-1]], float(mem.head_act_bytes))
    buffers[:, order[0]] += float(table.input_bytes)
    per_link, air = np.zeros((c, len(topo.links))), np.zeros((c, len(topo.links)))
    for l, link in enumerate(topo.links):
        s, d = topo.device_names.index(link.src), topo.device_names.index(link.dst)
        nbytes = wire[j[l], mod[:, l], ab[:, l]]
        air[:, l] = nbytes * 8.0 / (float(table.bandwidth_mbps[l]) * 1e3)  # the table's copy of the link
        handoff = [np.broadcast_to(np.asarray(x, np.float64), (len(topo.links),))[l]
                   for x in (table.handoff_ms, table.handoff_ms_per_byte)]
        per_link[:, l] = air[:, l] + float(table.link_latency_ms[l]) + handoff[0] + handoff[1] * nbytes
        dev_ms[:, s] += send[s, j[l], mod[:, l]]
        dev_ms[:, d] += recv[d, j[l], mod[:, l]]
        for dd, w, act in ((s, terms.send_weight, terms.send_act), (d, terms.recv_weight, terms.recv_act)):
            weights[:, dd] += f(w)[j[l], mod[:, l]]
            acts[:, dd] = np.maximum(acts[:, dd], f(act)[j[l], mod[:, l]])
            buffers[:, dd] += nbytes
    if topo.kind == "chain":
        total = dev_ms.sum(1) + per_link.sum(1)
    else:
        agg = topo.post[0]
        branch = np.stack([dev_ms[:, topo.root] + per_link[:, topo.link_index(topo.root, b)] + dev_ms[:, b]
                           + per_link[:, topo.link_index(b, agg)] for b in topo.branches], 1)
        forks = {topo.link_index(topo.root, b) for b in topo.branches} | {topo.link_index(b, agg)
                                                                          for b in topo.branches}
        total = sum(dev_ms[:, x] for x in list(topo.pre) + list(topo.post)) + branch.max(1) \
            + sum(per_link[:, l] for l in range(len(topo.links)) if l not in forks)
    active, tx, rx = CE.powers(topo)
    en = active * dev_ms
    for l, link in enumerate(topo.links):
        en[:, topo.device_names.index(link.src)] += tx[l] * air[:, l]
        en[:, topo.device_names.index(link.dst)] += rx[l] * air[:, l]
    return {"T": total, "per_device": dev_ms, "per_link": per_link, "memory": weights + buffers + acts,
            "energy": en}
