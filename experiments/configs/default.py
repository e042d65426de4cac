"""The README's main job: chain preset, embedded digits, T_const = 2.8 ms."""
from jmsnas.configs import default_config


def get_config():
    return default_config()
