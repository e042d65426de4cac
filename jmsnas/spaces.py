"""The registry of search spaces by name: what a table file's ``space`` field and ``jmsnas measure --space`` name.

* ``mbconv13``: the 13-op MBConv space of the JMSNAS paper laid out over a topology (``jmsnas.space``; its shapes
  come from the run's configuration, so it is built by ``space.build_space``, not from a name alone);
* ``fbnet_c100``: HW-NAS-Bench's FBNet space for CIFAR-100 (``jmsnas.fbnet.space``), whose tables are per-layer
  (``jmsnas.cost.layertable``) and whose networks ``jmsnas measure`` can time.
"""
from __future__ import annotations

from jmsnas.fbnet import space as fbnet_space

# name -> factory of a space whose networks can be built from the name alone (None: needs a run configuration)
SPACES = {"mbconv13": None, "fbnet_c100": fbnet_space.fbnet_c100}


def get(name: str):
    """The space registered as ``name``; ValueError (one line) for an unknown name or one that needs a config."""
    if name not in SPACES:
        raise ValueError(f"unknown search space {name!r}; expected one of {sorted(SPACES)}")
    if SPACES[name] is None:
        raise ValueError(f"search space {name!r} is laid out from a run configuration (jmsnas.space.build_space), "
                         f"not from its name; spaces built from a name: {sorted(k for k, v in SPACES.items() if v)}")
    return SPACES[name]()
