"""docs/configuration.md is generated from the built-in configurations (jmsnas.commands.configref): every key has
a unit and a meaning there, no entry names a key that is gone, the page in the repository is the generator's
output of today's code, and the commands' --help points to it."""
import os

import pytest

from paths import REPO

from jmsnas import cli
from jmsnas.commands import configref


def test_every_key_is_documented_and_every_entry_is_a_key():
    assert configref.undocumented() == []


def test_the_page_is_up_to_date():
    with open(os.path.join(REPO, configref.PAGE), encoding="utf-8") as f:
        page = f.read()
    assert page == configref.markdown(), (
        f"{configref.PAGE} is stale: python -m jmsnas.commands.configref {configref.PAGE}")


def test_the_page_lists_every_key_with_its_default():
    page = configref.markdown()
    for key in ("t_const_ms", "cost.tables", "search.lambda2", "evolve.population", "splitnets.bus_mbps",
                "fbnet.tables", "net.alpha", "cluster.bandwidth_mbps"):
        assert f"| `{key}` |" in page, key
    assert "| `t_const_ms` | `2.8` | ms |" in page


def test_a_new_key_without_an_entry_is_caught(monkeypatch):
    from jmsnas import configs
    default = configs.default_config

    def with_new_key():
        c = default()
        c.search.new_knob = 1
        return c
    monkeypatch.setattr(configs, "default_config", with_new_key)
    assert "The main job: search.new_knob has no entry" in configref.undocumented()


@pytest.mark.parametrize("command", ["search", "retrain", "evolve", "separable"])
def test_help_points_to_the_reference(command):
    parser, sub = cli.build_parser()
    assert configref.PAGE in sub.choices[command].format_help().replace("\n", " ")
    assert configref.PAGE in parser.format_help()
