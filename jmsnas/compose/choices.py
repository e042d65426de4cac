"""What the composed search chooses, and the probabilities of its independent gates.

Four independent choices (each a softmax over its own logits, like the ops):

* ``ops`` per layer slot n: the candidate op (``jmsnas.space.OPS``), float[N, R];
* ``weight_bits`` per layer slot n: the bit width of its weights, float[N, Bw]; it matters only where the layer
  runs on a device that quantizes (``Choices.quantize``), elsewhere the weights stay float32;
* ``module`` per link l: no split module (index 0) or a SplitNets Conv-Reduce/Conv-Recover pair that sends
  max(1, c // r) of the c channels at the cut (index k >= 1: r = ``Choices.modules[k - 1]``), float[L, K];
* ``act_bits`` per link l: the bit width of the transmitted tensor, float[L, Ba] (32: float32, 16: float16,
  1..8: packed integers and their range, ``jmsnas.quant.packing.frame_bytes``).

A choice indexed by link (not by cut position) stays well defined when the split is searched: whichever layer
boundary a link crosses, that link's module and bits apply to it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.gates import probabilities

WEIGHT_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)  # what jmsnas.quant.quantizers fake-quantizes (32: float)
ACT_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)  # what jmsnas.quant.packing packs or sends raw
FLOAT_BITS = 32


def _ints(what, values, allowed=None, least=None) -> tuple:
    try:
        vals = list(values)
    except TypeError:
        raise ValueError(f"{what} must be a list of integers, got {values!r}") from None
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what}: {v!r} is not an integer")
        if allowed is not None and v not in allowed:
            raise ValueError(f"{what}: {v!r} is not one of {list(allowed)}")
        if least is not None and v < least:
            raise ValueError(f"{what}: {v!r} must be an integer >= {least}")
    if len(set(vals)) != len(vals):
        raise ValueError(f"{what}: {list(vals)} repeats a value")
    return tuple(int(v) for v in vals)


class Choices(NamedTuple):
    """The static description of the composed choices (hashable: a jit static argument).

    Attributes:
      modules: reductions r >= 2 of the split modules; () = no modules (the module choice is then only "none").
      weight_bits: candidate weight bit widths, (32,) = off.
      act_bits: candidate bit widths of a transmitted tensor, (32,) = off.
      quantize: bool per device: whether its layers' weights take ``weight_bits`` (others stay float32).
      module_optional: whether a link may carry no module; False: "none" is masked out of every link's module
        choice (probability 0, never sampled or derived), so every cut carries one of ``modules``.
      send_input: whether a split may hand on the input itself (a chain under a searched split): the stem then
        runs on the device of the first layer or on one before it, and the links before it carry the image, at
        boundary ``input_boundary(space)`` (N + 1), with that cut's module and transmitted bits.
    """

    modules: tuple = ()
    weight_bits: tuple = (FLOAT_BITS,)
    act_bits: tuple = (FLOAT_BITS,)
    quantize: tuple = ()
    module_optional: bool = True
    send_input: bool = False

    @property
    def num_modules(self) -> int:
        """K: the candidates of a link's module choice, "none" included."""
        return 1 + len(self.modules)

    def group_masks(self) -> tuple:
        """bool masks of the valid candidates of (weight bits, module, transmitted bits): only the module's
        "none" can be masked out (``module_optional=False``)."""
        return (np.ones(len(self.weight_bits), bool), np.array([self.module_optional] + [True] * len(self.modules)),
                np.ones(len(self.act_bits), bool))

    def row_masks(self, groups) -> tuple:
        """The masks of ``group_masks`` broadcast to the shapes of ``groups``, the logits (or probabilities) of
        (weight bits, module, transmitted bits): one mask row per layer or link."""
        return tuple(jnp.broadcast_to(jnp.asarray(m), jnp.shape(a)) for a, m in zip(groups, self.group_masks()))

    @property
    def off(self) -> bool:
        return (not self.modules and self.weight_bits == (FLOAT_BITS,) and self.act_bits == (FLOAT_BITS,)
                and not self.send_input)


def make_choices(topology, modules=(), weight_bits=(), act_bits=(), quantize=None,
                 module_optional=True, send_input=False) -> Choices:
    """Validated ``Choices`` for ``topology``: ``modules`` reductions (ints >= 2, [] = off), ``weight_bits`` /
    ``act_bits`` bit widths ([] or [32] = off), ``quantize`` (bool per device; default: every device but the
    last in execution order), ``module_optional`` (False: every cut carries a module) and ``send_input`` (True: a
    split may send the input itself; a chain only). A ValueError names the bad value."""
    mods = _ints("modules", modules, least=2)
    if not isinstance(module_optional, (bool, np.bool_)):
        raise ValueError(f"module_optional must be true or false, got {module_optional!r}")
    if not isinstance(send_input, (bool, np.bool_)):
        raise ValueError(f"send_input must be true or false, got {send_input!r}")
    if send_input and topology.kind != "chain":
        raise ValueError(f"send_input: true needs a chain (the stem moves along it); topology {topology.name!r} "
                         f"is a {topology.kind}")
    if not module_optional and not mods:
        raise ValueError("module_optional: false needs at least one reduction in modules, got modules []")
    wb = _ints("weight_bits", weight_bits, WEIGHT_BITS) or (FLOAT_BITS,)
    ab = _ints("activation_bits", act_bits, ACT_BITS) or (FLOAT_BITS,)
    m = topology.num_devices
    if quantize is None:
        last = topology.path_order()[-1]
        quantize = tuple(d != last for d in range(m))
    quantize = tuple(quantize)
    if len(quantize) != m or any(not isinstance(q, (bool, np.bool_)) for q in quantize):
        raise ValueError(f"quantize must be one true/false per device {list(topology.device_names)}, got "
                         f"{list(quantize)}")
    return Choices(mods, tuple(sorted(wb)), tuple(sorted(ab)), tuple(bool(q) for q in quantize), bool(module_optional),
                   bool(send_input))


class ChoiceProbs(NamedTuple):
    """Probabilities of every gate (rows sum to 1; one-hot rows: one discrete configuration).

    ops float[N, R], weight_bits float[N, Bw], module float[L, K], act_bits float[L, Ba]."""

    ops: jnp.ndarray
    weight_bits: jnp.ndarray
    module: jnp.ndarray
    act_bits: jnp.ndarray


class Config(NamedTuple):
    """One discrete configuration: indices ops int[N], weight_bits int[N] (into ``Choices.weight_bits``),
    module int[L] (0: none), act_bits int[L] (into ``Choices.act_bits``)."""

    ops: np.ndarray
    weight_bits: np.ndarray
    module: np.ndarray
    act_bits: np.ndarray


def logits_shapes(space, choices: Choices) -> ChoiceProbs:
    """The shape of every group of logits, as a ChoiceProbs of tuples."""
    n, links = space.num_layers, len(space.topology.links)
    return ChoiceProbs((n, space.mask().shape[1]), (n, len(choices.weight_bits)), (links, choices.num_modules),
                       (links, len(choices.act_bits)))


def probs_from_logits(space, choices: Choices, logits: ChoiceProbs) -> ChoiceProbs:
    """softmax of every group of logits over its valid candidates (the ops' mask, ``Choices.group_masks``)."""
    return ChoiceProbs(probabilities(logits.ops, jnp.asarray(space.mask())),
                       *(probabilities(a, m) for a, m in zip(logits[1:], choices.row_masks(logits[1:]))))


def onehot(space, choices: Choices, config: Config) -> ChoiceProbs:
    """The one-hot ChoiceProbs of a discrete configuration."""
    shapes = logits_shapes(space, choices)
    oh = lambda idx, shape: jax.nn.one_hot(jnp.asarray(idx), shape[1], dtype=jnp.float32)
    return ChoiceProbs(*(oh(i, s) for i, s in zip(config, shapes)))
