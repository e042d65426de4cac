"""PyTorch reference of the jmsnas supernet, for benchmarks/bench_vs_pytorch.py only (never imported by jmsnas).

Written the way a PyTorch user would write a one-shot supernet: one ``nn.Module`` per candidate, NCHW tensors
(optionally ``channels_last``), ``nn.BatchNorm2d``, ``F.conv2d`` with ``groups`` for the depthwise convolution,
only the listed paths computed, autograd for every gradient, ``torch.optim.Adam``.

Same network as ``jmsnas.supernet`` for a ``SearchSpace``: a 3x3 stem (conv, BN, ReLU6), one searchable layer
per slot, a 1x1 head conv (BN, ReLU6), global average pooling and a dense classifier. A layer's candidates are
MBConv (1x1 expand, BN, ReLU6, k x k depthwise, BN, ReLU6, 1x1 project, BN, optional shortcut) and identity; a
mixed layer outputs sum_k g[paths[k]] * v_{paths[k]}(x).

Weights: with ``shared=True`` (the default, as ``jmsnas.supernet.init``'s default) each layer holds one
superkernel (widest expansion, 7x7 depthwise) and a candidate uses its leading channels and centred k x k window
(Once-for-All style slicing), with its own batch norms; so a candidate costs exactly its own FLOPs. With
``shared=False`` every candidate has its own weights (ProxylessNAS style).

Padding: ``exact_padding=False`` (the natural choice, used for timing) pads k // 2 on every side; for stride 2
on an even size TensorFlow/XLA "SAME" pads one less on the low side, so outputs are shifted by one pixel but the
work is identical. ``exact_padding=True`` pads like XLA (an extra F.pad) so the outputs can be compared with
jmsnas value for value (``load_jax_params``).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from jmsnas.space import OPS, SearchSpace

BN_MOMENTUM = 0.1  # torch convention: new = (1 - m) * old + m * batch; jmsnas keeps 0.9 of the old value
BN_EPS = 1e-5


def _same_pad(size: int, k: int, stride: int) -> tuple:
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


def _bn(ch: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(ch, eps=BN_EPS, momentum=BN_MOMENTUM)


def _he(*shape) -> nn.Parameter:
    fan_in = int(np.prod(shape[1:]))
    return nn.Parameter(torch.randn(*shape) * np.sqrt(2.0 / fan_in))


class Candidate(nn.Module):
    """One MBConv candidate of a layer slot; its conv weights are passed in (shared) or its own (separate)."""

    def __init__(self, op, slot, kmax: int, shared: bool, exact_padding: bool):
        super().__init__()
        self.k, self.stride, self.residual = op.kernel, slot.stride, op.residual
        self.mid, self.lo = slot.in_ch * op.expand, (kmax - op.kernel) // 2
        self.in_hw, self.exact_padding = slot.in_hw, exact_padding
        self.bn1, self.bn2, self.bn3 = _bn(self.mid), _bn(self.mid), _bn(slot.out_ch)
        if not shared:
            self.expand = _he(self.mid, slot.in_ch, 1, 1)
            self.dw = _he(self.mid, 1, self.k, self.k)
            self.project = _he(slot.out_ch, self.mid, 1, 1)

    def depthwise(self, h, w):
        if self.exact_padding:
            lo, hi = _same_pad(self.in_hw, self.k, self.stride)
            return F.conv2d(F.pad(h, (lo, hi, lo, hi)), w, stride=self.stride, groups=self.mid)
        return F.conv2d(h, w, stride=self.stride, padding=self.k // 2, groups=self.mid)

    def forward(self, x, expand=None, dw=None, project=None):
        if expand is None:  # separate weights
            expand, dw, project = self.expand, self.dw, self.project
        else:  # slices of the layer's superkernel
            expand = expand[:self.mid]
            dw = dw[:self.mid, :, self.lo:self.lo + self.k, self.lo:self.lo + self.k]
            project = project[:, :self.mid]
        h = F.relu6(self.bn1(F.conv2d(x, expand)))
        h = F.relu6(self.bn2(self.depthwise(h, dw)))
        h = self.bn3(F.conv2d(h, project))
        return h + x if self.residual else h


class Identity(nn.Module):
    def forward(self, x, *weights):
        return x


class SearchLayer(nn.Module):
    """Layer slot n: its valid candidates (op indices ``valid``) and, if shared, the superkernel."""

    def __init__(self, space: SearchSpace, n: int, shared: bool, exact_padding: bool):
        super().__init__()
        slot = space.layers[n]
        self.valid = [int(i) for i in np.flatnonzero(space.mask()[n])]
        convs = [OPS[i] for i in self.valid if not OPS[i].is_identity]
        kmax, mid_max = max(o.kernel for o in convs), slot.in_ch * max(o.expand for o in convs)
        self.shared = shared
        if shared:
            self.expand = _he(mid_max, slot.in_ch, 1, 1)
            self.dw = _he(mid_max, 1, kmax, kmax)
            self.project = _he(slot.out_ch, mid_max, 1, 1)
        self.candidates = nn.ModuleDict({
            str(i): Identity() if OPS[i].is_identity else Candidate(OPS[i], slot, kmax, shared, exact_padding)
            for i in self.valid})

    def path(self, i: int, x):
        cand = self.candidates[str(i)]
        return cand(x, self.expand, self.dw, self.project) if self.shared else cand(x)

    def forward(self, x, gate_row, paths=None):
        """sum_i gate_row[i] * v_i(x) over ``paths`` (op indices; every valid candidate when None)."""
        out = None
        for i in (self.valid if paths is None else paths):
            y = gate_row[i] * self.path(int(i), x)
            out = y if out is None else out + y
        return out


class Supernet(nn.Module):
    """The whole supernet of a chain ``SearchSpace`` (each layer reads the previous one)."""

    def __init__(self, space: SearchSpace, shared: bool = True, exact_padding: bool = False):
        super().__init__()
        if space.topology.kind != "chain":
            raise ValueError(f"the torch reference wires chains only, got a {space.topology.kind!r} topology")
        self.stem = nn.Conv2d(space.in_channels, space.stem_channels, 3, space.stem_stride, 1, bias=False)
        self.stem_bn = _bn(space.stem_channels)
        self.layers = nn.ModuleList([SearchLayer(space, n, shared, exact_padding) for n in range(space.num_layers)])
        self.head = nn.Conv2d(space.layers[-1].out_ch, space.head_channels, 1, bias=False)
        self.head_bn = _bn(space.head_channels)
        self.fc = nn.Linear(space.head_channels, space.num_classes)

    def forward(self, x, gates, paths=None):
        """Logits [B, classes]; ``gates`` tensor[N, R]; ``paths[n]`` op indices to compute (all valid if None)."""
        h = F.relu6(self.stem_bn(self.stem(x)))
        for n, layer in enumerate(self.layers):
            h = layer(h, gates[n], None if paths is None else paths[n])
        h = F.relu6(self.head_bn(self.head(h)))
        return self.fc(h.mean((2, 3)))


def compact_net(space: SearchSpace, ops, exact_padding: bool = False) -> nn.Module:
    """The derived network of ``ops`` as plain modules (nn.Conv2d/BatchNorm2d/ReLU6 in Sequentials)."""
    blocks = [nn.Conv2d(space.in_channels, space.stem_channels, 3, space.stem_stride, 1, bias=False),
              _bn(space.stem_channels), nn.ReLU6()]
    for slot, i in zip(space.layers, ops):
        op = OPS[int(i)]
        if not op.is_identity:
            blocks.append(MBConv(op, slot, exact_padding))
    blocks += [nn.Conv2d(space.layers[-1].out_ch, space.head_channels, 1, bias=False), _bn(space.head_channels),
               nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(space.head_channels, space.num_classes)]
    return nn.Sequential(*blocks)


class MBConv(nn.Module):
    """A stand-alone MBConv with its own nn.Conv2d modules (the compact network's block)."""

    def __init__(self, op, slot, exact_padding: bool):
        super().__init__()
        mid, k = slot.in_ch * op.expand, op.kernel
        pad = 0 if exact_padding else k // 2
        self.pre_pad = _same_pad(slot.in_hw, k, slot.stride) * 2 if exact_padding else None
        self.expand = nn.Sequential(nn.Conv2d(slot.in_ch, mid, 1, bias=False), _bn(mid), nn.ReLU6())
        self.dw = nn.Conv2d(mid, mid, k, slot.stride, pad, groups=mid, bias=False)
        self.dw_rest = nn.Sequential(_bn(mid), nn.ReLU6(), nn.Conv2d(mid, slot.out_ch, 1, bias=False),
                                     _bn(slot.out_ch))
        self.residual = op.residual

    def forward(self, x):
        h = self.expand(x)
        if self.pre_pad is not None:
            h = F.pad(h, self.pre_pad)
        h = self.dw_rest(self.dw(h))
        return h + x if self.residual else h


# ----- copying jmsnas parameters in (for the value check) -----

def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, np.float32))


def _set_bn(bn: nn.BatchNorm2d, p: dict, st: dict, v: int, ch: int) -> None:
    bn.weight.data.copy_(_t(p["scale"][v, :ch]))
    bn.bias.data.copy_(_t(p["bias"][v, :ch]))
    bn.running_mean.copy_(_t(st["mean"][v, :ch]))
    bn.running_var.copy_(_t(st["var"][v, :ch]))


def load_jax_params(model: Supernet, space: SearchSpace, params, state) -> None:
    """Copies ``jmsnas.supernet.init`` parameters/BN state (shared or separate weights) into ``model``."""
    with torch.no_grad():
        model.stem.weight.copy_(_t(np.asarray(params["stem"]["w"]).transpose(3, 2, 0, 1)))
        _set_bn(model.stem_bn, {k: np.asarray(a)[None] for k, a in params["stem"]["bn"].items()},
                {k: np.asarray(a)[None] for k, a in state["stem"]["bn"].items()}, 0, space.stem_channels)
        for n, layer in enumerate(model.layers):
            p = {k: np.asarray(a) if not isinstance(a, dict) else {kk: np.asarray(b) for kk, b in a.items()}
                 for k, a in params["layers"][n].items()}
            st = {k: {kk: np.asarray(b) for kk, b in a.items()} for k, a in state["layers"][n].items()}
            conv = {"expand": p["expand"].transpose(0, 2, 1)[..., None, None],  # [W, M, Cin, 1, 1]
                    "dw": p["dw"].transpose(0, 3, 1, 2)[:, :, None],  # [W, M, 1, k, k]
                    "project": p["project"].transpose(0, 2, 1)[..., None, None]}  # [W, Cout, M, 1, 1]
            if layer.shared:
                for name in conv:
                    getattr(layer, name).copy_(_t(conv[name][0]))
            for v, i in enumerate(layer.valid):
                cand = layer.candidates[str(i)]
                if isinstance(cand, Identity):
                    continue
                if not layer.shared:
                    cand.expand.copy_(_t(conv["expand"][v][:cand.mid]))
                    cand.dw.copy_(_t(conv["dw"][v][:cand.mid, :, cand.lo:cand.lo + cand.k,
                                                   cand.lo:cand.lo + cand.k]))
                    cand.project.copy_(_t(conv["project"][v][:, :cand.mid]))
                for name, bn, ch in (("bn1", cand.bn1, cand.mid), ("bn2", cand.bn2, cand.mid),
                                     ("bn3", cand.bn3, cand.bn3.num_features)):
                    _set_bn(bn, p[name], st[name], v, ch)
        model.head.weight.copy_(_t(np.asarray(params["head"]["conv"]).T[..., None, None]))
        _set_bn(model.head_bn, {k: np.asarray(a)[None] for k, a in params["head"]["bn"].items()},
                {k: np.asarray(a)[None] for k, a in state["head"]["bn"].items()}, 0, space.head_channels)
        model.fc.weight.copy_(_t(np.asarray(params["head"]["dense_w"]).T))
        model.fc.bias.copy_(_t(params["head"]["dense_b"]))


# ----- the steps -----

def sampled_weight_step(model: Supernet, opt, x, y, gates, paths):
    """One weight step on the listed paths (one per layer in the two-path scheme's weight step)."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, gates, paths), y)
    loss.backward()
    opt.step()
    return loss


def mixture_weight_step(model: Supernet, opt, x, y, gates):
    """One weight step with every valid path computed and weighted by ``gates`` (held fixed)."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, gates, None), y)
    loss.backward()
    opt.step()
    return loss


class LatencyTerm:
    """E[T](alpha) of a chain under its fixed split: sum_n p_n . U[device(n), n, :] + constant (ms); and the
    penalty lambda2 * (E[T] - T_const)^2 (jmsnas.objectives.latency_penalty, two-sided)."""

    def __init__(self, mask, per_layer_ms, const_ms: float, t_const_ms: float, lambda2: float, device="cpu"):
        self.mask = torch.as_tensor(np.asarray(mask), device=device)
        self.per_layer_ms = _t(per_layer_ms).to(device)
        self.const_ms, self.t_const_ms, self.lambda2 = const_ms, t_const_ms, lambda2

    def probabilities(self, logits):
        return torch.softmax(logits.masked_fill(~self.mask, float("-inf")), dim=-1)

    def penalty(self, alpha):
        t = (self.probabilities(alpha) * self.per_layer_ms).sum() + self.const_ms
        return self.lambda2 * (t - self.t_const_ms) ** 2


def two_path_arch_step(model: Supernet, alpha, opt, x, y, paths, active, lat: LatencyTerm):
    """ProxylessNAS binary gates: two paths per layer computed, g = one-hot(active path); dL/dg by autograd,
    dL/dalpha by eq. (5) over the pair (softmax renormalised over it), plus the latency term's gradient."""
    n, r = alpha.shape
    paths_t = torch.as_tensor(paths, device=alpha.device)
    chosen = paths_t[torch.arange(n, device=alpha.device), torch.as_tensor(active, device=alpha.device)]
    gates = F.one_hot(chosen, r).float().requires_grad_()
    ce = F.cross_entropy(model(x, gates, paths), y)
    (dl_dg,) = torch.autograd.grad(ce, gates)
    with torch.no_grad():
        p = torch.softmax(alpha.gather(1, paths_t), dim=-1)
        d = dl_dg.gather(1, paths_t)
        d_pair = p * d - p * (d * p).sum(-1, keepdim=True)
    opt.zero_grad(set_to_none=True)
    lat.penalty(alpha).backward()
    with torch.no_grad():
        alpha.grad.scatter_add_(1, paths_t, d_pair)
    opt.step()
    return ce


def mixture_arch_step(model: Supernet, alpha, opt, x, y, lat: LatencyTerm, tau=None):
    """Every valid path computed; g = softmax(alpha) (tau None) or Gumbel-softmax at temperature tau;
    the gradient is taken with respect to alpha only (no weight gradients are formed)."""
    logits = alpha if tau is None else (alpha - torch.log(-torch.log(torch.rand_like(alpha)))) / tau
    gates = lat.probabilities(logits)
    loss = F.cross_entropy(model(x, gates, None), y) + lat.penalty(alpha)
    (grad,) = torch.autograd.grad(loss, alpha)
    alpha.grad = grad
    opt.step()
    return loss


def compact_train_step(net: nn.Module, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return loss


def compact_eval(net: nn.Module, x, y):
    """(correct, summed loss) of one batch in eval mode, as jmsnas's eval step returns."""
    with torch.inference_mode():
        logits = net(x)
        return (logits.argmax(-1) == y).sum(), F.cross_entropy(logits, y, reduction="sum")
