"""SplitNets, multi-view (V = 4): ``jmsnas evolve --config experiments/configs/splitnets_multiview.py --workdir W``.

Four sensors each see one 12 x 12 corner crop of every digit (upsampled to 16 x 16) (``jmsnas.splitnets.views``), run the on-sensor
network (weights shared across views), and send their reduced features over one 1.2 Gbit/s bus shared by the four
(300 Mbit/s each); the aggregator concatenates the four (View-Fuse) and finishes with its own blocks (no weight
sharing with the sensors). Limits scaled as in ``splitnets_single.py``: 20 kB of sensor memory, T_const = 2.5 us.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("splitnets_single", os.path.join(os.path.dirname(__file__),
                                                                                "splitnets_single.py"))
_single = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_single)


def get_config(arg: str = ""):
    c = _single.get_config(arg)
    c.splitnets.views = 4
    c.t_const_ms = 0.0025
    return c
