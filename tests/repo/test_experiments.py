"""experiments/configs/fig5.py: the six Fig. 5 configs, their T_const levels, and the summary of experiments/fig5.py.

No training: the configs are loaded as ``jmsnas search --config`` loads them; the reachable range is checked
against the exact budget repair (an independent Pareto DP) and against random architectures of the space.
"""
from __future__ import annotations

import importlib.util
import os

import ml_collections
import numpy as np
import pytest

from jmsnas import budget, pipeline
from jmsnas.configs import load_config
from jmsnas.cost.latency import arch_latency

from paths import REPO as ROOT
CONFIG = os.path.join(ROOT, "experiments", "configs", "fig5.py")
TOPOLOGIES, LEVELS = ("chain", "mesh"), ("tight", "mid", "loose")


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def configs():
    mod = _module(CONFIG, "fig5_config")  # one module: the reachable range is computed once per topology
    return {(t, l): mod.get_config(f"{t}:{l}") for t in TOPOLOGIES for l in LEVELS}


def test_cli_loader_gives_the_same_config(configs):
    """``jmsnas search --config experiments/configs/fig5.py:mesh:tight`` passes "mesh:tight" to get_config."""
    assert load_config(f"{CONFIG}:mesh:tight").to_dict() == configs[("mesh", "tight")].to_dict()


@pytest.fixture(scope="module")
def spaces(configs):
    out = {}
    for t in TOPOLOGIES:
        cfg = ml_collections.ConfigDict(configs[(t, "mid")].to_dict())
        out[t] = pipeline.build(cfg, pipeline.load_data(cfg))
    return out


def test_six_configs_are_the_main_job_but_for_t_const(configs):
    from jmsnas.configs import default_config, mesh_config
    for (t, l), cfg in configs.items():
        pipeline.validate_config(cfg)
        base = (default_config if t == "chain" else mesh_config)().to_dict()
        mine = cfg.to_dict()
        assert mine.pop("experiment")["topology"] == t and cfg.experiment.level == l
        mine.pop("t_const_ms"), base.pop("t_const_ms")
        assert mine == base


def test_levels_ordered_and_strictly_inside_the_reachable_range(configs):
    for t in TOPOLOGIES:
        ts = [configs[(t, l)].t_const_ms for l in LEVELS]
        e = configs[(t, "mid")].experiment
        assert e.reachable_min_ms < ts[0] < ts[1] < ts[2] < e.reachable_max_ms, (t, ts, e)
        for l, v in zip(LEVELS, ts):
            frac = configs[(t, l)].experiment.fraction
            assert v == pytest.approx(e.reachable_min_ms + frac * (e.reachable_max_ms - e.reachable_min_ms), abs=1e-4)


def test_reachable_min_is_the_repair_dp_minimum(configs, spaces):
    """T_min agrees with budget.repair's exact Pareto-DP minimum (an independent computation)."""
    for t in TOPOLOGIES:
        space, table = spaces[t]
        mask = space.mask()
        alpha = np.zeros(mask.shape, np.float32)
        first_valid = np.array([np.flatnonzero(mask[n])[0] for n in range(space.num_layers)], np.int32)
        fix = budget.repair(space, table, alpha, first_valid, 1e-6)
        assert configs[(t, "mid")].experiment.reachable_min_ms == pytest.approx(fix.min_latency_ms, rel=1e-5)


def test_no_random_architecture_leaves_the_reachable_range(configs, spaces):
    rng = np.random.default_rng(0)
    for t in TOPOLOGIES:
        space, table = spaces[t]
        e = configs[(t, "mid")].experiment
        mask = space.mask()
        lats = []
        for _ in range(20):
            ops = np.array([rng.choice(np.flatnonzero(mask[n])) for n in range(space.num_layers)], np.int32)
            lats.append(float(arch_latency(space, table, ops).total))
        assert min(lats) >= e.reachable_min_ms - 1e-5 and max(lats) <= e.reachable_max_ms + 1e-5
        assert max(lats) - min(lats) > 0.0  # the ops do change T, so the levels are not all the same budget


def test_bad_argument_names_the_expected_form():
    mod = _module(CONFIG, "fig5_config")
    for bad in ("chain", "ring:tight", "mesh:medium", ""):
        with pytest.raises(ValueError, match="<topology>:<level>"):
            mod.get_config(bad)


def _row(topo, level, t_final, t_stage1):
    return {"topology": topo, "level": level, "fraction": 0.5, "t_const_ms": 2.7, "t_min_ms": 2.5, "t_max_ms": 3.0,
            "stage1_latency_ms": t_stage1, "stage1_expected_ms": t_stage1, "stage1_val_acc": 0.9,
            "latency_ms": t_final, "budget": {"met": True, "repaired": False}, "val_acc": 0.95, "test_acc": 0.94,
            "params": 1234, "wall_s": 60.0, "resumed": False, "history": [], "workdir": "x"}


def test_summary_reports_the_trend_per_topology():
    runner = _module(os.path.join(ROOT, "experiments", "fig5.py"), "fig5_runner")
    rows = [_row("chain", "tight", 2.6, 2.6), _row("chain", "mid", 2.7, 2.9), _row("chain", "loose", 2.8, 2.8),
            _row("mesh", "tight", 2.6, 2.6), _row("mesh", "mid", 2.6, 2.6), _row("mesh", "loose", 2.9, 2.9)]
    assert runner.trend(rows, "chain") == "falls"
    assert runner.trend(rows, "chain", "stage1_latency_ms") == "does not fall"
    assert runner.trend(rows, "mesh") == "non-increasing (ties)"
    assert runner.trend(rows[:2], "chain") == "incomplete"
    md = runner.summary_markdown(rows, quick=False)
    assert md.count("\n| chain |") == 3 and md.count("\n| mesh |") == 3
    assert "- chain: final T falls; stage-1 derived T does not fall" in md


def test_plot_has_the_scatter_and_one_stage1_panel_pair_per_topology(tmp_path):
    runner = _module(os.path.join(ROOT, "experiments", "fig5.py"), "fig5_runner")
    hist = [{"epoch": e, "stage": "warmup" if e < 1 else "search", "val_acc": 0.5, "expected_latency_ms": 2.8,
             "derived_latency_ms": 2.7} for e in range(3)]
    rows = [dict(_row("chain", "tight", 2.6, 2.7), history=hist), dict(_row("mesh", "loose", 2.9, 2.9), history=hist)]
    fig = runner.plot_fig5(rows, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    assert len(fig.axes) == 5
    assert len(fig.axes[0].collections) >= 4  # filled + hollow point per run (plus legend proxies)


def _separable_result(g, acc_c, acc_r, last_c, last_r, mean_c, mean_r, ref=0.9, control=(0.75, 0.65)):
    arm = lambda acc: {"test_acc": acc, "cost": {"bytes_ratio": 0.5}}
    return {"network": {"G": g, "alpha": 2, "K": 1, "float16": False}, "controller": arm(acc_c),
            "random": arm(acc_r), "reference": {"test_acc": ref},
            "reward_summary": {"controller": {"last_round_mean_reward": last_c, "mean_reward": mean_c},
                               "random": {"last_round_mean_reward": last_r, "mean_reward": mean_r},
                               "random_on_controller_weights": {"last_round_mean_reward": control[0],
                                                                "mean_reward": control[1]}}}


def test_separable_summary_counts_the_runs_where_the_controller_wins():
    """experiments/separable.py's per-variant summary over seeds: means, ranges and the win counts by hand."""
    mod = _module(os.path.join(ROOT, "experiments", "separable.py"), "separable_experiment")
    results = {"g4a2": (_separable_result(4, 0.80, 0.70, 0.9, 0.8, 0.7, 0.6), None),
               "g4a2_seed1": (_separable_result(4, 0.90, 0.80, 0.7, 0.8, 0.7, 0.6), None)}
    rows = mod.summary(results).splitlines()
    assert rows[2].startswith("| ResNeXt G=4 | non-separated") and "90.00% (90.00-90.00)" in rows[2]
    g4 = rows[3].split(" | ")
    assert g4[0] == "| g4a2" and g4[2] == "2" and g4[3] == "85.00% (80.00-90.00)" and g4[4] == "75.00%"
    assert g4[7] == "1/2 / 2/2" and g4[8] == "0.800 / 0.800"
    # the control group (0.75 last round, 0.65 all steps in both runs): beaten in the last round by seed 0's 0.9
    # only, over all steps by both (0.7 > 0.65)
    assert g4[9] == "1/2 / 2/2" and g4[10] == "0.750 |"


COMPOSED = os.path.join(ROOT, "experiments", "configs", "composed.py")


def test_composed_configs_are_the_main_job_but_for_the_method_budget_and_seed():
    from jmsnas.configs import default_config
    mod = _module(COMPOSED, "composed_config")
    base = default_config().to_dict()
    for method, switches in mod.METHODS.items():
        cfg = load_config(f"{COMPOSED}:{method}:1.2:2")
        pipeline.validate_config(cfg)
        mine = cfg.to_dict()
        assert mine.pop("t_const_ms") == 1.2 and mine.pop("seed") == 2
        assert {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in mine.pop("compose").items()} == \
            {**base["compose"], **switches}
        assert mine.pop("split") == mod.SPLIT[method] == ("searched" if method == "composed" else "fixed")
        assert mine == {k: v for k, v in base.items() if k not in ("t_const_ms", "seed", "compose", "split")}
    mem = load_config(f"{COMPOSED}:composed:2.8:0:ue80k")
    assert mem.topology.endswith("ue_memory_80k.yaml") and os.path.isfile(mem.topology)
    for bad in ("composed:1.2", "autosplit:1.2:0", "composed:-1:0", "composed:fast:0", "composed:1.2:0:big"):
        with pytest.raises(ValueError, match=r"METHOD:T_CONST:SEED\[:ue80k\]"):
            mod.get_config(bad)


def test_composed_reaches_are_ordered_and_jmsnas_alone_is_the_fastest_architecture():
    """The experiment skips a budget below a method's least reachable T (the composed repair at T_const = 0);
    JMSNAS alone's equals the fastest op at every layer (fig5's independent computation)."""
    runner = _module(os.path.join(ROOT, "experiments", "composed.py"), "composed_runner")
    reach = {m: runner.reach(m) for m in runner.SEARCHED}
    fig5 = _module(CONFIG, "fig5_config")
    t_min, _ = fig5.reachable_range(runner.config("jmsnas", 2.8, 0, False, False))
    assert reach["jmsnas"] == pytest.approx(t_min, rel=1e-5)
    assert reach["composed"] < reach["module"] < reach["jmsnas"]
