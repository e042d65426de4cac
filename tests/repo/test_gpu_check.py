"""benchmarks/gpu_check.sh's CPU side (GPU_CHECK_CPU=1: the same steps on the CPU, tiny, native kernels off):
every step runs, passes, and lands in the one JSON it writes."""
import json
import os
import subprocess

import pytest

from paths import REPO


@pytest.mark.slow
def test_the_gpu_check_runs_its_steps_on_the_cpu_and_writes_one_json(tmp_path):
    try:
        import torch  # noqa: F401  (the bench extra; without it the PyTorch arms are skipped and recorded so)
        have_torch = True
    except ImportError:
        have_torch = False
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JMSNAS_"))}
    env.update(GPU_CHECK_CPU="1", JMSNAS_CACHE_DIR=str(tmp_path / "unused-cache"))
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=2000)
    record = json.loads(out.read_text())
    failed = {k: v["tail"] for k, v in record["steps"].items() if v["rc"] != 0 and not v.get("skipped")}
    assert proc.returncode == 0 and record["ok"] and not failed, (proc.stdout[-2000:], proc.stderr[-2000:], failed)
    steps = record["steps"]
    assert list(steps) == ["tests", "main_twice", "vs_pytorch", "batched_eval"] and record["mode"] == "cpu"
    assert " passed" in steps["tests"]["result"]
    twice = steps["main_twice"]["result"]
    assert twice["result_identical"] and twice["history_identical"] and len(twice["runs"]) == 2
    assert twice["runs"][1]["time"]["cache_hits"] == twice["runs"][1]["time"]["compilations"] > 0
    if not have_torch:
        assert steps["vs_pytorch"]["skipped"] and "jax_batched_over_torch_loop" not in steps["batched_eval"]["result"]
        return
    rows = steps["vs_pytorch"]["result"]["rows"]
    assert [r["mode"] for r in rows] == ["derived_forward", "two_path_weight"]
    assert all(r["jax_img_s"] > 0 and r["torch_img_s"] > 0 for r in rows)
    assert steps["vs_pytorch"]["result"]["torch_device"] == "cpu"
    ratios = steps["batched_eval"]["result"]["jax_batched_over_torch_loop"]
    assert set(ratios) == {"plain", "bn_recal"} and all(v > 0 for v in ratios.values())
