"""FBNet space on one Raspberry Pi 4 with HW-NAS-Bench's per-layer table (HELP's data, tests/data/help_fbnet):
single-path supernet on the digits, then evolution under T_const = 25 ms (the table's networks span 7.8-43 ms).
``jmsnas search|evolve --config experiments/configs/fbnet_raspi4.py --workdir runs/fbnet``; quick:
``--config.fbnet.fitness=flops``."""
import os

import ml_collections

HELP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "help_fbnet",
                    "fbnet_lut_pixel3_raspi4.json")


def get_config():
    c = ml_collections.ConfigDict()
    c.topology = "raspberry_pi4"  # a device preset (one device) or a chain topology file with 22 layers in all
    c.dataset = "digits"
    c.t_const_ms = 25.0
    c.fbnet = ml_collections.ConfigDict(dict(
        width=0.25, tables={"raspberry_pi4": HELP + ":raspi4"}, fitness="supernet", supernet_epochs=2,
        batch_size=64, lr=3e-3, population=32, generations=8, fitness_examples=229, seed=0))
    return c
