"""jmsnas.tensorboard: the scalars it derives (hand-checked), and a tiny search whose event files, read back with
TensorBoard's own reader, hold every scalar the issue names. (The evolve, SplitNets and separable runs are checked
in their own end-to-end tests: test_evolve, test_splitnets, test_separable.)"""
import json
import math
import os

import ml_collections
import numpy as np
import pytest

import tinyrun
from jmsnas import configs, pipeline, tensorboard as tb
from jmsnas.space import OP_NAMES


def test_arch_scalars_entropy_by_hand():
    p = np.zeros((3, 4))
    p[0] = [0.25, 0.25, 0.25, 0.25]  # uniform over 4: log 4
    p[1] = [0.0, 1.0, 0.0, 0.0]  # decided: 0
    p[2] = [0.5, 0.0, 0.5, 0.0]  # two equal, masked zeros ignored: log 2
    s = tb.arch_scalars(p)
    assert s["arch/entropy/layer_00"] == pytest.approx(math.log(4))
    assert s["arch/entropy/layer_01"] == 0.0 and s["arch/top_op/layer_01"] == 1 and s["arch/top_prob/layer_01"] == 1
    assert s["arch/entropy/layer_02"] == pytest.approx(math.log(2)) and s["arch/top_op/layer_02"] == 0
    assert s["arch/entropy_mean"] == pytest.approx((math.log(4) + math.log(2)) / 3)


def test_breakdown_generation_and_history_scalars_by_hand():
    b = {"total": 3.0, "per_device": {"ue": 1.0, "sbs": 0.5}, "per_link": {"ue->sbs": 1.5}}
    assert tb.breakdown_scalars("latency/expected", b) == {
        "latency/expected_ms": 3.0, "latency/expected/device/ue_ms": 1.0, "latency/expected/device/sbs_ms": 0.5,
        "latency/expected/link/ue_to_sbs_ms": 1.5}
    g = tb.generation_scalars([0.5, 0.9, 0.7], [1.0, 3.0, 2.0], [True, False, True], [0.4, -np.inf, 0.6])
    assert g["evolution/fitness_best"] == 0.6 and g["evolution/fitness_mean"] == pytest.approx(0.5)
    assert g["evolution/feasible_fraction"] == pytest.approx(2 / 3) and g["evolution/accuracy_best_feasible"] == 0.7
    assert g["evolution/latency_min_ms"] == 1.0 and g["evolution/latency_max_ms"] == 3.0
    row = {"epoch": 2, "train_loss": 0.5, "val_acc": 0.75, "expected_latency_ms": None}
    assert tb.history_scalars(row) == {"train/loss": 0.5, "val/accuracy": 0.75}


def test_separable_steps_are_global_controller_steps():
    arm = {"train_loss": 1.0, "best_acc": 0.5, "sample_acc": [0.4, 0.6], "sample_bytes_ratio": [0.2, 0.4],
           "rewards": [0.1, 0.2, 0.3]}
    entry = {"round": 2, "controller": {**arm, "random_on_controller_weights": [0.0, 0.1, 0.2]}, "random": arm}
    per_round, per_step = tb.separable_round_scalars(entry, ctrl_steps=3)
    assert per_round["controller/sample_accuracy_mean"] == pytest.approx(0.5)
    assert per_round["random/reward_round_mean"] == pytest.approx(0.2)
    assert [s for s, _ in per_step] == [6, 7, 8]
    assert per_step[2][1] == {"controller/reward": 0.3, "random/reward": 0.3, "control_group/reward": 0.2}


@pytest.mark.slow
def test_outside_a_run_or_switched_off_nothing_is_written(tmp_path):
    tb.log(0, {"a": 1.0})  # no writer: nothing happens
    with tb.run(str(tmp_path), False) as w:
        assert w is None and not tb.active()
        tb.log(0, {"a": 1.0})
    assert not (tmp_path / tb.DIRNAME).exists()
    with tb.run(str(tmp_path), True) as w:
        assert tb.active()
        tb.log(3, {"a": 1.0, "b": None, "c": float("nan")})
    assert not tb.active()
    scalars, images = tb.read(str(tmp_path))
    assert scalars == {"a": [(3, 1.0)]} and images == []


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_tensorboard_setting_that_is_not_a_bool_is_refused(value):
    cfg = ml_collections.ConfigDict({**configs.default_config().to_dict(), "tensorboard": value})
    with pytest.raises(ValueError, match="tensorboard must be true or false"):
        pipeline.validate_config(cfg)


@pytest.mark.slow
def test_tiny_search_logs_every_scalar(tmp_path, tiny_config):
    cfg = tiny_config
    cfg.search.gate_mode = "gumbel_soft"  # a mode that samples with a temperature
    cfg.max_train, cfg.max_eval, cfg.search.warmup_epochs = 64, 64, 0
    result = pipeline.search(cfg, str(tmp_path), progress=False)
    tinyrun.assert_common_top_level(json.loads((tmp_path / "result.json").read_text()), "search")
    scalars, images = tb.read(str(tmp_path))
    devices, links = ("ue", "sbs", "mbs", "cloud"), ("ue_to_sbs", "sbs_to_mbs", "mbs_to_cloud")
    layers = len(result["architecture"])
    want = {"train/loss", "train/accuracy", "val/accuracy", "latency/expected_ms", "latency/derived_ms",
            "search/gumbel_temperature", "arch/entropy_mean", "result/accuracy/val", "result/accuracy/test",
            "result/latency_ms", "result/params"}
    want |= {f"latency/expected/device/{d}_ms" for d in devices} | {f"latency/expected/link/{l}_ms" for l in links}
    want |= {f"result/latency/device/{d}_ms" for d in devices} | {f"memory/{d}/weight_bytes" for d in devices}
    want |= {f"memory/{d}/{k}" for d in devices for k in ("bytes", "limit_bytes")}  # against each limit
    want |= {f"arch/{k}/layer_{n:02d}" for k in ("entropy", "top_op", "top_prob") for n in range(layers)}
    assert want <= set(scalars), sorted(want - set(scalars))
    assert images == ["figures/architecture", "figures/history", "figures/latency_breakdown"]
    # one point per epoch (search 1 + retrain 1), the values those of history.json / result.json
    assert [s for s, _ in scalars["val/accuracy"]] == [0, 1]
    assert scalars["result/accuracy/test"] == [(2, pytest.approx(result["accuracy"]["test"]))]
    assert scalars["result/latency/link/ue_to_sbs_ms"][0][1] == pytest.approx(
        result["latency_ms"]["per_link"]["ue->sbs"])
    # the temperature follows the schedule at the step the epoch ended
    steps = 64 // cfg.search.batch_size
    assert scalars["search/gumbel_temperature"][0][1] == pytest.approx(max(0.1, 5.0 * 0.97 ** steps), rel=1e-5)
    assert all(0 <= v < len(OP_NAMES) for _, v in scalars["arch/top_op/layer_00"])
    # the weights each device holds: its part's parameters and BN statistics, 4 bytes each
    total = sum(v[0][1] for t, v in scalars.items() if t.startswith("memory/") and t.endswith("/weight_bytes"))
    assert total >= 4 * result["params"]
    assert os.listdir(tmp_path / "tensorboard")
