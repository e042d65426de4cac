"""`jmsnas search` within every device's memory, and one-line refusals when no architecture fits."""
import json
import os
import textwrap

import numpy as np
import pytest
import yaml

from jmsnas import cli, configs, limits as L, pipeline

TINY = textwrap.dedent("""
    from jmsnas.configs import default_config, tiny
    def get_config():
        c = tiny(default_config())
        c.dw_impl = "xla"
        return c
""")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_cfg(topology):
    c = configs.tiny(configs.default_config())
    c.topology = str(topology)
    return c


def _topology(tmp_path, ue_memory=None, ue_energy=None, name="t.yaml"):
    t = yaml.safe_load(open(os.path.join(REPO, "experiments", "topologies", "paper_chain.yaml")))
    if ue_memory is not None:
        t["devices"][0]["memory_bytes"] = float(ue_memory)
    if ue_energy is not None:
        t["devices"][0]["energy_budget_mj"] = float(ue_energy)
    t["layers_per_device"] = [1, 1, 1, 1]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(t))
    return path


def _ue_bounds(tmp_path):
    """(least, most) bytes any architecture of the tiny space needs on the UE."""
    cfg = _tiny_cfg(_topology(tmp_path, name="free.yaml"))
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    lim = L.device_limits(space)
    return L.least_need(space, table, lim, 0)[0], L.upper_bounds(space, table, lim)[0][0], space, table


@pytest.mark.slow
def test_search_keeps_every_device_within_its_memory(tmp_path):
    least, most, space, table = _ue_bounds(tmp_path)
    limit = least + 0.15 * (most - least)  # most of the UE's candidates do not fit
    cfgfile = tmp_path / "tiny.py"
    cfgfile.write_text(TINY)
    topo = _topology(tmp_path, ue_memory=limit)
    argv = ["search", "--config", str(cfgfile), "--workdir", str(tmp_path / "run"), "--no-progress",
            f"--config.topology={topo}", "--config.t_const_ms=3.0"]
    assert cli.main(argv) in (0, None)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    mem = result["memory"]
    assert mem["ue"]["limit_bytes"] == limit and all(m["within"] for m in mem.values())
    assert all(m["bytes"] <= m["limit_bytes"] for m in mem.values())
    assert result["budget"]["met"] and result["latency_ms"]["total"] <= 3.0
    assert "Memory per device" in (tmp_path / "run" / "summary.txt").read_text()
    assert result["energy"]["total"] is not None and result["energy"]["per_device"]["ue"]["mj"] > 0


@pytest.mark.parametrize("what", ["memory", "energy"])
def test_infeasible_limits_fail_with_one_line_and_write_nothing(tmp_path, capsys, what):
    least, most, space, table = _ue_bounds(tmp_path)
    lim = L.device_limits(space)
    if what == "memory":
        topo, t_const, needle = _topology(tmp_path, ue_memory=least - 1), 3.0, "device 'ue' needs at least"
    elif what == "energy":
        need = L.least_need(space, table, lim, 0)[1]
        topo, t_const, needle = _topology(tmp_path, ue_energy=0.9 * need), 3.0, "device 'ue' needs at least"
    # (T_const with a limit: tests/test_limits.py::test_limits_that_only_bind_with_t_const_...; analytic tables
    # make a device's fastest candidates its smallest, so that case needs other latencies)
    cfgfile = tmp_path / "tiny.py"
    cfgfile.write_text(TINY)
    workdir = tmp_path / "run"
    code = cli.main(["search", "--config", str(cfgfile), "--workdir", str(workdir), "--no-progress",
                     f"--config.topology={topo}", f"--config.t_const_ms={t_const}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not workdir.exists()
