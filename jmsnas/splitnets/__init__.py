"""SplitNets (paper 000) as a system: the split module, multi-view sensors on a shared bus, and its search.

* ``module``: Conv-Reduce phi: c -> d (sensor side), Conv-Recover phi': d -> c and View-Fuse (concat of V reduced
  views, then V*d -> c) on the aggregator side, with the split-aware (geometric-mean) initialisation of Table 3.
* ``hardware``: SplitNets' head-mounted system (sensor NPU, aggregator NPU, one bus shared by V sensors) and the
  latency, bytes on the bus and sensor peak memory of a split network.
* ``views``: V deterministic partial views of each image (embedded digits or any tfds image dataset).
* ``space`` / ``net``: the split-aware search space (phases, searched depth, split position and d) and its
  weight-sharing supernet as pure functions.
* ``search``: sandwich-rule supernet training, evolution under hard latency and sensor-memory limits, retraining,
  result.json / plots / per-device parts (``jmsnas evolve --config experiments/configs/splitnets_*.py``).
"""
