"""The per-choice cost terms of a composed space, built once (numpy, then float32 arrays: a pytree).

Boundaries: a cut between devices falls at a layer boundary j in 0..N: j = 0 is the stem's output (the first
device runs no layer), j = n + 1 is layer n's output. With ``Choices.send_input`` one more, j = N + 1
(``input_boundary``): the input image itself, sent before the stem (which then runs on a later device). The tensor
at boundary j has hw x hw x c elements per image.

* Layers: ``layer_ms[m, n, i, b]`` is the compute latency (ms) of op i at slot n on device m with its weights at
  ``weight_bits[b]``. It is the cost table's U_n^m(v_i) for float weights, on devices that do not quantize and on
  devices whose latencies are not a roofline of their own profile (a measured table has no bit dimension: those
  stay as measured); on a quantizing roofline device it is the roofline of ``jmsnas.cost.tables.roofline_ms``
  with the weights read at b bits (activations at 32 bits), as ``jmsnas autosplit``'s roofline charges them.
  ``weight_bytes[m, n, i, b]`` is what the layer stores on device m: its parameters and batch-norm statistics
  (``cost.memory.op_stored_params``) packed at b bits where m quantizes, float32 elsewhere.
* Modules (SplitNets, paper 000, section 3.1.3; ``jmsnas.splitnets.module``): module k >= 1 at boundary j sends
  d = max(1, c // r_k) channels. Its Conv-Reduce (1x1, c -> d, no bias) runs on the sender and its Conv-Recover
  (d -> c) on the receiver, each charged the roofline of the device's own profile (``send_ms``/``recv_ms``
  [M, J, K], ms), storing c * d float32 weights (``send_weight``/``recv_weight`` [J, K], bytes) and holding its
  input and output while it runs (``send_act``/``recv_act`` [J, K], bytes at the memory table's activation bits).
  Module 0 is "none": zero everywhere and the whole tensor is sent.
* Wire: ``wire_bytes[j, k, a]`` = ``jmsnas.quant.packing.frame_bytes(hw * hw * d_k, act_bits[a])``, exactly
  what the deployed link carries per image (``jmsnas.compose.network``: 1..8 bits are the codes packed,
  ``transmitted_bytes``, plus the tensor's range, 8 bytes; 16 bits float16; 32 bits float32). A frame of B images
  carries B x the codes and one range. Link terms are functions of these bytes (``jmsnas.cost.latency.link_ms``:
  eps plus a measured hand-off), not precomputed constants, so other per-link costs of the bytes add to them.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jmsnas.compose.choices import FLOAT_BITS, Choices
from jmsnas.cost.memory import op_stored_params
from jmsnas.cost.tables import CostTable, roofline_ms
from jmsnas.quant.packing import frame_bytes
from jmsnas.space import OPS, op_flops, op_params


class Terms(NamedTuple):
    """Per-choice terms (float32 arrays; ms and bytes per image). Shapes: M devices, N slots, R ops, Bw weight
    bit widths, J = N + 1 boundaries (N + 2 with ``Choices.send_input``), K module choices ("none" first), Ba
    transmitted bit widths."""

    layer_ms: jnp.ndarray  # [M, N, R, Bw]
    weight_bytes: jnp.ndarray  # [M, N, R, Bw]
    send_ms: jnp.ndarray  # [M, J, K]
    recv_ms: jnp.ndarray  # [M, J, K]
    send_weight: jnp.ndarray  # [J, K]
    recv_weight: jnp.ndarray  # [J, K]
    send_act: jnp.ndarray  # [J, K]
    recv_act: jnp.ndarray  # [J, K]
    wire_bytes: jnp.ndarray  # [J, K, Ba]
    act_values: jnp.ndarray  # [V]: the distinct non-zero module working sets (where E[max] is evaluated)


def boundary_shapes(space, send_input: bool = False) -> list:
    """(hw, c) of the tensor at every boundary j = 0..N (0: the stem's output), and with ``send_input`` at
    j = N + 1, the input image."""
    out = [(space.stem_out_hw, space.stem_channels)] + [(s.out_hw, s.out_ch) for s in space.layers]
    return out + [(space.image_size, space.in_channels)] * bool(send_input)


def input_boundary(space) -> int:
    """The boundary index of the input image (N + 1; it exists where ``Choices.send_input``)."""
    return space.num_layers + 1


def module_channels(c: int, r: int) -> int:
    """Channels a module of reduction r sends from a c-channel tensor: max(1, c // r)."""
    return max(1, c // r)


def reduces(c: int, r: int) -> bool:
    """Whether a module of reduction r has something to reduce in a c-channel tensor (d < c). Where it has not
    (a one-channel image: d = c = 1) the cut carries no module: no Conv-Reduce/Recover, no weights, the whole
    tensor on the wire, whatever the module choice."""
    return module_channels(c, r) < c


def _packed(elems, bits) -> float:
    return float(-(-int(elems) * int(bits) // 8))


def _layer_terms(space, table: CostTable, choices: Choices, roofline_devices):
    devices, mask = space.topology.devices, space.mask()
    base = np.asarray(table.compute_ms, np.float64)  # [M, N, R]
    nb = len(choices.weight_bits)
    ms = np.repeat(base[..., None], nb, axis=-1)
    params = np.array([[op_stored_params(o, s) for o in OPS] for s in space.layers], np.float64)
    wbytes = np.repeat(np.repeat((params * 4.0)[None, ..., None], len(devices), 0), nb, -1)
    for m, d in enumerate(devices):
        if not choices.quantize[m]:
            continue
        for b, bits in enumerate(choices.weight_bits):
            wbytes[m, :, :, b] = [[_packed(op_stored_params(o, s), bits) for o in OPS] for s in space.layers]
            if bits == FLOAT_BITS or m not in roofline_devices:
                continue
            for n, s in enumerate(space.layers):
                for i, o in enumerate(OPS):
                    if o.is_identity or not mask[n, i]:
                        continue
                    p = op_params(o, s)
                    acts = _op_act_elems(o, s)
                    ms[m, n, i, b] = roofline_ms(op_flops(o, s), 4.0 * acts + p * bits / 8.0, d)
    wbytes = np.where(mask[None, ..., None], wbytes, 0.0)
    return ms, wbytes


def _op_act_elems(o, s) -> int:
    """Activation elements an op reads and writes (``space.op_memory_bytes`` without the weights)."""
    mid = s.in_ch * o.expand
    return s.in_hw ** 2 * s.in_ch + s.in_hw ** 2 * mid * 2 + s.out_hw ** 2 * mid * 2 + s.out_hw ** 2 * s.out_ch


def _module_terms(space, choices: Choices, activation_bits: int):
    devices = space.topology.devices
    shapes = boundary_shapes(space, choices.send_input)
    j, k, m = len(shapes), choices.num_modules, len(devices)
    send_ms, recv_ms = np.zeros((m, j, k)), np.zeros((m, j, k))
    weight, act = np.zeros((j, k)), np.zeros((j, k))
    wire = np.zeros((j, k, len(choices.act_bits)))
    for jj, (hw, c) in enumerate(shapes):
        for kk in range(k):
            none = kk == 0 or not reduces(c, choices.modules[kk - 1])
            d = c if none else module_channels(c, choices.modules[kk - 1])
            for a, bits in enumerate(choices.act_bits):
                wire[jj, kk, a] = frame_bytes(hw * hw * d, bits)
            if none:
                continue
            flops, traffic = 2.0 * hw * hw * c * d, 4.0 * (hw * hw * (c + d) + c * d)
            for mm, dev in enumerate(devices):
                send_ms[mm, jj, kk] = recv_ms[mm, jj, kk] = roofline_ms(flops, traffic, dev)
            weight[jj, kk] = 4.0 * c * d
            act[jj, kk] = _packed(hw * hw * (c + d), activation_bits)
    return send_ms, recv_ms, weight, act, wire


def build_terms(space, table: CostTable, choices: Choices, activation_bits: int = 32,
                roofline_devices=None) -> Terms:
    """The ``Terms`` of ``space`` under ``table`` and ``choices``. ``activation_bits`` is the width of the memory
    table's working sets (``cost.memory.space_memory``); ``roofline_devices`` the indices of the devices whose
    table rows are the roofline of their own profile (default: all), the only ones whose latency changes with
    the weights' bit width."""
    if len(choices.quantize) != space.topology.num_devices:
        raise ValueError(f"choices.quantize has {len(choices.quantize)} entries, expected one per device "
                         f"{list(space.topology.device_names)}")
    roofline_devices = set(range(space.topology.num_devices) if roofline_devices is None else roofline_devices)
    ms, wbytes = _layer_terms(space, table, choices, roofline_devices)
    send_ms, recv_ms, weight, act, wire = _module_terms(space, choices, activation_bits)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    values = np.unique(act[act > 0])
    return Terms(f32(ms), f32(wbytes), f32(send_ms), f32(recv_ms), f32(weight), f32(weight), f32(act), f32(act),
                 f32(wire), f32(values))
