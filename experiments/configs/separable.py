"""Separable networks over G devices (paper 004) at our scale: the embedded digits, a 2-stage Sep-ResNeXt.

``get_config("g4a2")`` (default): G = 4 nodes, alpha = 2, no sparsity, float32 transfer. The argument is
``g<G>a<alpha>`` optionally followed by ``k<K>`` (K sparsity levels from 50 % to 100 %, Table 4) and ``f16``
(float16 transfer), e.g. ``g4a2k9f16``; ``tiny`` (or a ``:tiny`` suffix) gives a few steps of everything.

  jmsnas separable --config experiments/configs/separable.py:g4a2k9f16 --workdir runs/separable/g4a2k9f16
"""
from __future__ import annotations

import re

from jmsnas.separable.config import default_config, tiny

_PATTERN = re.compile(r"^g(\d+)a(\d+)(?:k(\d+))?(f16)?$")


def get_config(arg: str = "g4a2"):
    name, _, extra = str(arg).partition(":")
    if name == "tiny":
        name, extra = "g4a2", "tiny"
    m = _PATTERN.match(name)
    if not m or extra not in ("", "tiny"):
        raise ValueError(f"separable config argument must look like g4a2, g4a2k9 or g4a2k9f16 (optionally "
                         f"':tiny'), got {arg!r}")
    c = default_config()
    c.net.num_groups, c.net.alpha = int(m.group(1)), int(m.group(2))
    c.net.num_levels = int(m.group(3) or 1)
    c.net.float16 = m.group(4) is not None
    return tiny(c) if extra == "tiny" else c
