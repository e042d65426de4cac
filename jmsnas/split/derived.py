"""A searched network as a layer graph (``jmsnas.graph.NetSpec``), so the split baselines can take it.

``net_from_space(space, ops)`` lists, per image, what ``supernet.compact_apply`` computes: the stem (k = 3
convolution + batch norm), per layer the chosen MBConv as three layers (1x1 expansion, k x k depthwise, 1x1
projection, each with its batch norm; a "add" layer for the shortcut) or nothing for an identity, a "mean" of the
branch outputs where a mesh's aggregator merges them, and the head (1x1 convolution, global pool, classifier).
MACs and parameters follow ``space.op_flops`` / ``space.op_params`` (tested against them).

``load_result(path)`` reads a run's ``result.json`` (``jmsnas search`` / ``evolve``), which records the space
(``space``: ``jmsnas.space.to_dict``, its topology included) and the op of every layer (``architecture``).
"""
from __future__ import annotations

from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.run import directory
from jmsnas.space import OPS, SearchSpace, from_dict, op_index
from jmsnas.topology import Topology, TopologyError


def net_from_space(space: SearchSpace, ops, name: str = "derived") -> NetSpec:
    """The compact network of ``ops`` (one op index per layer slot) on ``space`` as a NetSpec."""
    space.validate_arch(ops)
    layers = []

    def add(lname, kind, macs, params, shape, inputs):
        layers.append(LayerSpec(lname, kind, int(macs), int(params), tuple(int(x) for x in shape),
                                tuple(i for i in inputs if i >= 0)))
        return len(layers) - 1

    hw, cin, c = space.stem_out_hw, space.in_channels, space.stem_channels
    stem = add("stem", "conv", hw * hw * 9 * cin * c, 9 * cin * c + 2 * c, (hw, hw, c), ())
    out = {}  # layer slot -> index of the NetSpec layer holding its output
    for s, i in zip(space.layers, ops):
        srcs = [stem if j < 0 else out[j] for j in space.input_of(s.index)]
        src = srcs[0]
        if len(srcs) > 1:  # the aggregator averages the mesh branches
            src = add(f"L{s.index}.merge", "mean", 0, 0, (s.in_hw, s.in_hw, s.in_ch), srcs)
        op = OPS[int(i)]
        if op.is_identity:
            out[s.index] = src
            continue
        mid = s.in_ch * op.expand
        e = add(f"L{s.index}.expand", "conv", s.in_hw ** 2 * s.in_ch * mid, s.in_ch * mid + 2 * mid,
                (s.in_hw, s.in_hw, mid), (src,))
        d = add(f"L{s.index}.dw_k{op.kernel}", "dwconv", s.out_hw ** 2 * mid * op.kernel ** 2,
                mid * op.kernel ** 2 + 2 * mid, (s.out_hw, s.out_hw, mid), (e,))
        p = add(f"L{s.index}.project", "conv", s.out_hw ** 2 * mid * s.out_ch, mid * s.out_ch + 2 * s.out_ch,
                (s.out_hw, s.out_hw, s.out_ch), (d,))
        out[s.index] = add(f"L{s.index}.add", "add", 0, 0, (s.out_hw, s.out_hw, s.out_ch), (p, src)) \
            if op.residual else p
    hw, c = space.head_in
    h = space.head_channels
    last = out[space.num_layers - 1]
    conv = add("head.conv", "conv", hw * hw * c * h, c * h + 2 * h, (hw, hw, h), (last,))
    pool = add("head.pool", "pool", 0, 0, (h,), (conv,))
    add("head.fc", "fc", h * space.num_classes, h * space.num_classes + space.num_classes, (space.num_classes,),
        (pool,))
    net = NetSpec(name, (space.image_size, space.image_size, space.in_channels), tuple(layers))
    net.validate()
    return net


def from_result(obj: dict, source: str = "result.json") -> tuple:
    """(NetSpec, Topology, SearchSpace) of a run's parsed result.json: the derived network with its shapes."""
    try:
        space = from_dict(obj["space"], "space")
        topo: Topology = space.topology
        arch = obj["architecture"]
        if [a["layer"] for a in arch] != list(range(space.num_layers)):
            raise ValueError(f"architecture lists layers {[a['layer'] for a in arch]}, expected 0..{space.num_layers - 1}")
        ops = [op_index(a["op"]) for a in arch]
        net = net_from_space(space, ops, f"{topo.name}-derived")
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TopologyError):
            raise
        raise ValueError(f"{source}: not a usable search result ({type(e).__name__}: {e})") from None
    return net, topo, space


def load_result(path: str) -> tuple:
    """(NetSpec, Topology, SearchSpace) of a run's result.json file (see ``from_result``)."""
    obj = directory.read_json(path, "result")
    if not directory.is_result(obj):
        raise ValueError(f"{path}: not a search result (needs architecture and space; written by "
                         "jmsnas search/evolve)")
    return from_result(obj, path)
