"""The derived composed network: the compact network of one configuration, as it is deployed.

``composed_apply(space, choices, config, assignment, params, state, module_params, x)`` is
``supernet.compact_apply`` of ``config.ops`` (``params``/``state`` from ``supernet.extract``) with

* every layer's kernels (``expand``, ``dw``, ``project``) fake-quantized at its weight bits
  (``quantizers.fake_quant_weight``: symmetric per output channel at 2..8 bits, float16 at 16, unchanged at 32)
  where its device quantizes (``Choices.quantize``); batch norm, the stem and the head stay float32;
* at every link l, on the tensor that crosses it (boundary j = ``cost.link_boundaries(space, assignment)[l]``: j = 0
  the stem's output, j = n + 1 layer n's output): the chosen split module's Conv-Reduce c -> d (d =
  ``terms.module_channels(c, r)``, ``splitnets.module.reduce`` on the first d channels of the boundary's weights),
  the transmitted tensor at its bits (``wire_values``: 1..8 bits asymmetric over the [min, max] of the whole batch
  of the d channels sent, not of zero padding, and back, ``quantizers.act_codes``/``act_dequant``; 16 float16; 32
  unchanged), then the Conv-Recover d -> c. Where the split sends the input (an ``assignment`` of N + 1 entries,
  the last the stem's device: ``cost.split_devices``), the links from the first device to the stem's carry the
  image (boundary N + 1, ``terms.input_boundary``) with their module and bits, and the stem runs on what arrives.

A tensor that crosses several links (a device without layers relays it) takes every link's transform in path
order. With no module, 32-bit transmitted tensors and float weights it computes exactly what ``compact_apply``
computes (the same operations in the same order). Rounding has a straight-through gradient (the forward value is
the exact quantized one). ``config`` and ``assignment`` are concrete (numpy): they fix the network's structure, so
``jax.jit`` closes over them; the parameters and images may be traced.

Module weights (``init_modules``): {str(j): ``splitnets.module.init(key, c_j, d_max)``} for every boundary j, d_max
= max(1, c_j // min(Choices.modules)), views 1, kernel 1. A run directory stores a composed configuration as
``to_result`` (result.json's ``compose``) and ``write_parts`` (parts/, module weights beside the layers); the
deployed parts are ``jmsnas.deploy.composed``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas import space as S
from jmsnas.compose.choices import ACT_BITS, FLOAT_BITS, WEIGHT_BITS, Choices, Config, make_choices
from jmsnas.compose.cost import link_boundaries
from jmsnas.compose.terms import boundary_shapes, module_channels, reduces
from jmsnas.quant.quantizers import act_codes, act_dequant, fake_quant_weight
from jmsnas.run import directory
from jmsnas.space import OP_NAMES, OPS
from jmsnas.splitnets import module as SM


class Cut(NamedTuple):
    """What link ``link`` carries under a configuration: the tensor at ``boundary`` (``hw`` x ``hw`` x ``c``) from
    device index ``src`` to ``dst``, reduced by ``r`` (0: no module) to ``d`` channels, sent at ``bits``."""

    link: int
    boundary: int
    src: int
    dst: int
    hw: int
    c: int
    r: int
    d: int
    bits: int


def init_modules(key, space, choices: Choices) -> dict:
    """{str(j): split-module parameters} for every boundary j = 0..N (and N + 1, the input, with
    ``choices.send_input``; {} without modules): ``reduce`` float32[1, 1, c_j, d_max] and ``recover``
    float32[1, 1, d_max, c_j], d_max = max(1, c_j // min(modules))."""
    if not choices.modules:
        return {}
    shapes = boundary_shapes(space, choices.send_input)
    keys = jax.random.split(key, len(shapes))
    return {str(j): SM.init(k, c, module_channels(c, min(choices.modules))) for j, (k, (_, c)) in
            enumerate(zip(keys, shapes)) if reduces(c, min(choices.modules))}


def _bounds(space, a) -> np.ndarray:
    """``cost.link_boundaries`` as concrete numbers, also while a caller is being traced."""
    with jax.ensure_compile_time_eval():
        return np.asarray(link_boundaries(space, a))


def _assignment(space, assignment) -> np.ndarray:
    """The split as int64[N] (the stem on the first device) or int64[N + 1] (the stem's device last); ValueError
    naming it when it is neither."""
    a = np.asarray(space.layer_devices() if assignment is None else assignment).astype(np.int64)
    n = space.num_layers
    if a.shape not in ((n,), (n + 1,)) or a.min() < 0 or a.max() >= space.topology.num_devices:
        raise ValueError(f"assignment must be one device index in 0..{space.topology.num_devices - 1} per layer "
                         f"({n}), and optionally the stem's last, got {a.tolist()}")
    if len(a) == n + 1 and space.topology.kind != "chain":
        raise ValueError(f"a split that sends the input needs a chain; topology {space.topology.name!r} is a "
                         f"{space.topology.kind}")
    return a


def stem_device(space, assignment) -> int:
    """The device that runs the stem under ``assignment`` (``cost.split_devices``)."""
    a = _assignment(space, assignment)
    return int(a[space.num_layers]) if len(a) > space.num_layers else space.topology.path_order()[0]


def cuts(space, choices: Choices, config: Config, assignment=None) -> tuple:
    """A ``Cut`` per link, in the topology's link order."""
    topo, a = space.topology, _assignment(space, assignment)
    bounds = _bounds(space, a)
    shapes, names = boundary_shapes(space, True), topo.device_names
    out = []
    for l, link in enumerate(topo.links):
        j, k, ab = int(bounds[l]), int(config.module[l]), int(config.act_bits[l])
        hw, c = shapes[j]
        r = 0 if k == 0 or not reduces(c, int(choices.modules[k - 1])) else int(choices.modules[k - 1])
        out.append(Cut(l, j, names.index(link.src), names.index(link.dst), hw, c, r,
                       c if r == 0 else module_channels(c, r), int(choices.act_bits[ab])))
    return tuple(out)


def link_path(topo, a: int, b: int) -> list:
    """Link indices from device a to device b along the topology's links (chain and mesh: one path; [] for a == b);
    ValueError when b cannot be reached from a."""
    if a == b:
        return []
    names = topo.device_names
    for l, link in enumerate(topo.links):
        if names.index(link.src) == a:
            try:
                return [l] + link_path(topo, names.index(link.dst), b)
            except ValueError:
                continue
    raise ValueError(f"device {names[b]!r} cannot be reached from {names[a]!r} along the links of "
                     f"{topo.name!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _weight_q(w, bits: int):
    return fake_quant_weight(w, bits)


_weight_q.defvjp(lambda w, bits: (_weight_q(w, bits), None), lambda bits, _, g: (g,))


def layer_bits(space, choices: Choices, config: Config, assignment=None) -> tuple:
    """The bit width every layer's kernels are deployed at: its weight bits on a quantizing device, else 32."""
    a = _assignment(space, assignment)
    return tuple(int(choices.weight_bits[int(b)]) if choices.quantize[int(a[n])] else FLOAT_BITS
                 for n, b in enumerate(np.asarray(config.weight_bits)))


def quantize_layer(params_n, bits: int):
    """A layer's parameters with its kernels (the array entries; batch norm is a dict) fake-quantized at ``bits``
    (32: unchanged)."""
    if bits == FLOAT_BITS:
        return params_n
    return {k: v if isinstance(v, dict) else _weight_q(v, bits)
            for k, v in params_n.items()}


def _wire_fwd(z, bits: int):
    if bits >= FLOAT_BITS:
        return z
    if bits == 16:
        return z.astype(jnp.float16).astype(z.dtype)
    lo, hi = jnp.min(z), jnp.max(z)
    return act_dequant(act_codes(z, lo, hi, bits), lo, hi, bits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def wire_values(z, bits: int):
    """The transmitted tensor z float32[B, ...] as its receiver gets it at ``bits`` (static): 1..8 asymmetric over
    [min(z), max(z)] (the whole batch), 16 float16, 32 unchanged. Straight-through gradient."""
    return _wire_fwd(z, bits)


wire_values.defvjp(lambda z, bits: (_wire_fwd(z, bits), None), lambda bits, _, g: (g,))


def module_slice(p, d: int) -> dict:
    """A boundary's module weights cut to d channels: reduce [1, 1, c, d], recover [1, 1, d, c] (what a part
    stores)."""
    return {"reduce": p["reduce"][..., :d], "recover": p["recover"][:, :, :d, :]}


def send_side(p_d, y, d: int):
    """Conv-Reduce of y float32[B, s, s, c] with ``module_slice`` weights: float32[B, s, s, d]."""
    return SM.reduce(p_d, y, d)


def receive_side(p_d, z):
    """Conv-Recover of z float32[B, s, s, d] with ``module_slice`` weights: float32[B, s, s, c]."""
    return SM.recover(p_d, z)


def transmit(cut: Cut, module_params, y):
    """What ``cut``'s receiver holds of y: Conv-Reduce, the wire at its bits, Conv-Recover (no module: the wire)."""
    if cut.r == 0:
        return wire_values(y, cut.bits)
    p = module_slice(module_params[str(cut.boundary)], cut.d)
    return receive_side(p, wire_values(send_side(p, y, cut.d), cut.bits))


def composed_apply(space, choices: Choices, config: Config, assignment, params, state, module_params, x,
                   train: bool = False, dw_impl: str = "auto"):
    """Logits float32[B, classes] and the new batch-norm state of the composed network (module docstring)."""
    topo, a = space.topology, _assignment(space, assignment)
    ops = tuple(int(i) for i in np.asarray(config.ops))
    space.validate_arch(ops)
    plan, bits = cuts(space, choices, config, a), layer_bits(space, choices, config, a)
    first, last, stem = topo.path_order()[0], topo.path_order()[-1], stem_device(space, a)
    held = {}

    def route(y, at: int, dev: int, src: int, key):  # y (layer src's output, or a merge of it) from at to dev
        for l in link_path(topo, at, dev):
            if plan[l].boundary != src + 1:
                raise ValueError(f"link {topo.links[l].src}->{topo.links[l].dst} crosses boundary "
                                 f"{plan[l].boundary} under this assignment, but carries boundary {src + 1} "
                                 f"(assignment {a.tolist()} is not a split of {topo.name!r})")
            if (key, plan[l].dst) not in held:
                held[key, plan[l].dst] = transmit(plan[l], module_params, y)
            y = held[key, plan[l].dst]
        return y

    def deliver(src: int, dev: int):  # layer src's output (-1: the stem's) as device dev holds it
        return route(outputs[src], stem if src < 0 else int(a[src]), dev, src, src)

    x = route(x, first, stem, space.num_layers, "input")  # the image, as far as the stem's device (boundary N + 1)
    new_state = {}
    h, new_state["stem"] = O.conv_bn_apply(params["stem"], state["stem"], x, space.stem_stride, train)
    outputs = {-1: h}

    layer_states = []
    for s, i in zip(space.layers, ops):
        srcs = space.input_of(s.index)
        if len(srcs) == 1:
            inp = deliver(srcs[0], int(a[s.index]))
        else:  # a merge: the aggregator averages the branches' tensors, then sends the average on (a relay)
            agg = topo.post[0]
            xs = [deliver(j, agg) for j in srcs]
            inp = route(sum(xs) / len(xs), agg, int(a[s.index]), max(srcs), ("merge", s.index))
        y, st = O.op_apply(quantize_layer(params["layers"][s.index], bits[s.index]), state["layers"][s.index],
                           inp, OPS[i], s.stride, train, dw_impl)
        outputs[s.index] = y
        layer_states.append(st)
    new_state["layers"] = tuple(layer_states)
    logits, new_state["head"] = O.head_apply(params["head"], state["head"], deliver(space.num_layers - 1, last),
                                             train)
    return logits, new_state


# ------------------------------------------------------------------------------- the run directory's record

def to_result(space, choices: Choices, config: Config) -> dict:
    """result.json's ``compose``: {"modules": r or 0 per link, "weight_bits": bits per layer (read only where the
    layer's device quantizes), "activation_bits": bits per link, "quantize": true/false per device} (topology
    link order, layer order, device order)."""
    return {"modules": [0 if int(k) == 0 else int(choices.modules[int(k) - 1]) for k in np.asarray(config.module)],
            "weight_bits": [int(choices.weight_bits[int(b)]) for b in np.asarray(config.weight_bits)],
            "activation_bits": [int(choices.act_bits[int(b)]) for b in np.asarray(config.act_bits)],
            "quantize": [bool(q) for q in choices.quantize]}


def _list(what, value, n, where) -> list:
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"{where}: {what} must be a list of {n} values, got {value!r}")
    return value


def from_result(space, compose, ops, where: str = "result.json compose") -> tuple:
    """(Choices, Config) of a ``to_result`` record and the op indices ``ops``; ValueError (one line, naming the
    bad value) when it does not fit the space."""
    topo = space.topology
    if not isinstance(compose, dict):
        raise ValueError(f"{where} must be an object with modules, weight_bits, activation_bits, got {compose!r}")
    n, links = space.num_layers, len(topo.links)
    mods = _list("modules", compose.get("modules"), links, where)
    wb = _list("weight_bits", compose.get("weight_bits"), n, where)
    ab = _list("activation_bits", compose.get("activation_bits"), links, where)
    for what, vals, allowed in (("weight_bits", wb, WEIGHT_BITS), ("activation_bits", ab, ACT_BITS)):
        bad = [v for v in vals if isinstance(v, bool) or v not in allowed]
        if bad:
            raise ValueError(f"{where}: {what} {bad[0]!r} is not one of {list(allowed)}")
    bad = [r for r in mods if isinstance(r, bool) or not isinstance(r, int) or r == 1 or r < 0]
    if bad:
        raise ValueError(f"{where}: module {bad[0]!r} is neither 0 (none) nor a reduction >= 2")
    quantize = compose.get("quantize")
    if quantize is not None:
        quantize = _list("quantize", quantize, topo.num_devices, where)
    try:
        ch = make_choices(topo, sorted({r for r in mods if r}), sorted(set(wb)), sorted(set(ab)), quantize)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    cfg = Config(np.asarray(ops, np.int32), np.array([ch.weight_bits.index(b) for b in wb], np.int32),
                 np.array([0 if r == 0 else 1 + ch.modules.index(r) for r in mods], np.int32),
                 np.array([ch.act_bits.index(b) for b in ab], np.int32))
    return ch, cfg


def device_parts(space, config: Config, assignment, params, state, module_params) -> dict:
    """{device: {"params", "bn", "layers", "ops"}}: every device's float layers (``supernet.device_parts``' layout)
    and, under ``params["modules"]``, the full module weights of the boundaries its links cross: ``reduce`` on the
    sender, ``recover`` on the receiver (only for links with a module)."""
    topo, a = space.topology, _assignment(space, assignment)
    bounds = _bounds(space, a)
    parts = {topo.device_names[m]: {"params": {"layers": {}}, "bn": {"layers": {}}, "layers": [], "ops": []}
             for m in topo.path_order()}
    for s, i in zip(space.layers, np.asarray(config.ops)):
        part = parts[topo.device_names[int(a[s.index])]]
        part["layers"].append(s.index)
        part["ops"].append(OP_NAMES[int(i)])
        part["params"]["layers"][str(s.index)] = params["layers"][s.index]
        part["bn"]["layers"][str(s.index)] = state["layers"][s.index]
    for key, m in (("stem", stem_device(space, a)), ("head", topo.path_order()[-1])):
        part = parts[topo.device_names[m]]
        part["params"][key], part["bn"][key] = params[key], state[key]
    for l, link in enumerate(topo.links):
        if int(config.module[l]) == 0 or str(int(bounds[l])) not in module_params:  # none, or none that reduces
            continue
        p = module_params[str(int(bounds[l]))]
        for dev, side in ((link.src, "reduce"), (link.dst, "recover")):
            parts[dev]["params"].setdefault("modules", {}).setdefault(str(int(bounds[l])), {})[side] = p[side]
    return parts


def write_parts(workdir: str, space, config: Config, assignment, params, state, module_params) -> dict:
    """``parts/`` of a composed run (``run.directory.write_parts``): ``device_parts`` with the space recorded, as
    ``jmsnas.pipeline.write_parts`` writes a search's; the run's result.json adds ``compose`` (``to_result``) and
    the ``architecture`` (op and device per layer). Returns the parts manifest."""
    parts = device_parts(space, config, assignment, params, state, module_params)
    return directory.write_parts(workdir, parts, {"op_names": list(OP_NAMES), "space": S.to_dict(space)})
