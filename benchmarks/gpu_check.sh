#!/usr/bin/env bash
# The GPU check: jmsnas on one GPU in about 9.5 minutes, one JSON out.
#
#   bash benchmarks/gpu_check.sh [OUT.json]            # on a machine with a CUDA GPU (jax[cuda], torch with CUDA)
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh OUT    # the same steps on the CPU, tiny (CI: tests/repo/test_gpu_check.py)
#
# Steps, each under its own time limit (a step that runs out is recorded as timed out, rc 124):
#   tests        the tests of the paths a GPU takes (the XLA implementations "auto" picks off the CPU; no native
#                kernels: JMSNAS_NATIVE=0, and the tests of the native kernels deselected)
#   main_twice   the README's main job twice, empty cache first (benchmarks/bench_main_twice.py); on the GPU with
#                XLA_FLAGS=--xla_gpu_deterministic_ops=true, so "same result" says whether that makes runs repeatable
#   vs_pytorch   benchmarks/bench_vs_pytorch.py --reps 5, JAX on the GPU and PyTorch on CUDA
#   batched_eval benchmarks/bench_batched_eval.py at P = 64 with its PyTorch loop on CUDA
# OUT.json (default gpu_check.json): {"device", "mode", "steps": {name: {"rc", "skipped", "seconds", "limit_s",
# "timed_out", "tail", "result"}}, "ok"}; "result" is the step's own JSON (pytest: its summary line). Exit status
# 0 when every step passed. On the GPU, JAX_PLATFORMS=cuda makes a missing GPU an error instead of a silent CPU
# run, and torch (with CUDA) is required; the CPU side without torch skips the PyTorch arms (recorded so).
set -u
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-gpu_check.json}")
WORK=$(mktemp -d -t jmsnas-gpu-check-XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's jmsnas, installed or not
export JMSNAS_NATIVE=0
if [ "${GPU_CHECK_CPU:-0}" = "1" ]; then
    MODE=cpu
    export JAX_PLATFORMS=cpu
    # XLA's optimisation passes off: the CPU side checks that every step runs and reports, not how fast, and its
    # tiny programs spend most of their time compiling (bench_batched_eval's CPU arguments: 72.7 -> 53.7 s CPU)
    export JAX_DISABLE_MOST_OPTIMIZATIONS=1
    TORCH_DEVICE=cpu
    TESTS=(tests/test_gates.py)
    PYTEST_PAR=()
    cat > "$WORK/tiny.py" <<'PY'
from jmsnas.configs import default_config, tiny


def get_config():
    return tiny(default_config())
PY
    CONFIG="$WORK/tiny.py"
    VS_ARGS=(--modes derived_forward two_path_weight --steps-sampled 1 --no-check --batch 8
             --layers-per-device 1 1 1 1)
    # four searchable layers instead of eight (every row, check and compile of the GPU side, each half the size:
    # 50.1 -> 27.7 s CPU)
    EVAL_ARGS=(--population 4 --batch 16 --reps 1 --chunks 2 --bn-batches 1 --layers-per-device 1 1 1 1)
    LIMITS=(300 600 600 300)  # generous: CI's two cores run other tests beside it
    MAIN_ARGS=()
else
    MODE=gpu
    export JAX_PLATFORMS=cuda
    TORCH_DEVICE=cuda
    TESTS=(tests/test_gates.py tests/test_objectives.py tests/test_supernet.py tests/test_evaluate.py
           tests/native/test_dwconv.py)
    CONFIG=experiments/configs/default.py
    VS_ARGS=()
    EVAL_ARGS=(--population 64 --reps 5 --chunks 1,4 --bn-batches 2)
    # measured on one H100 (jax 0.11.2): XLA:GPU compiles slowly (the main job's first run 108 s, 82 s of it
    # compiling; its second 41 s), and the tests, one after the other, passed 48 of 83 in 100 s; four pytest
    # processes without preallocation passed 55 in 70 s. 540 s of steps: about 9.5 minutes with the start.
    LIMITS=(90 180 150 120)
    # on one H100 the two runs' result.json differed (XLA:GPU's scatter/reduction order varies run to run): the
    # main job runs with XLA's deterministic GPU ops, so the check says whether that makes a run repeatable
    MAIN_ARGS=(--xla-flags=--xla_gpu_deterministic_ops=true)
    PYTEST_PAR=(-n 4)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # four test processes and the benchmarks share one GPU
fi

step() {  # step NAME LIMIT_S COMMAND...: run it, keep its output and exit status
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s%N)
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $(( ($(date +%s%N) - t0) / 1000000 )) $limit" >> "$WORK/steps"
}

HAVE_TORCH=1
python -c "import torch" 2> /dev/null || HAVE_TORCH=0
NO_TORCH=()
if [ "$HAVE_TORCH" = "0" ]; then
    if [ "$MODE" = "gpu" ]; then
        echo "gpu_check: torch is not installed (pip install torch==2.13.0 with CUDA)" >&2
        exit 2
    fi
    NO_TORCH=(--no-torch)  # CPU side without torch (CI installs the test extra only): PyTorch arms skipped
fi

step tests "${LIMITS[0]}" python -m pytest -q -x "${PYTEST_PAR[@]}" -p no:cacheprovider -o addopts="" -k "not native" \
    "${TESTS[@]}"
step main_twice "${LIMITS[1]}" python benchmarks/bench_main_twice.py --config "$CONFIG" --json "$WORK/main_twice.json" \
    "${MAIN_ARGS[@]}"
if [ "$HAVE_TORCH" = "1" ]; then
    step vs_pytorch "${LIMITS[2]}" python benchmarks/bench_vs_pytorch.py --reps 5 --torch-device "$TORCH_DEVICE" \
        --json "$WORK/vs_pytorch.json" "${VS_ARGS[@]}"
else
    echo "skipped: torch is not installed" > "$WORK/vs_pytorch.log"
    echo "vs_pytorch skipped 0 ${LIMITS[2]}" >> "$WORK/steps"
fi
step batched_eval "${LIMITS[3]}" python benchmarks/bench_batched_eval.py --torch-device "$TORCH_DEVICE" \
    --json "$WORK/batched_eval.json" "${EVAL_ARGS[@]}" "${NO_TORCH[@]}"

python - "$WORK" "$OUT" "$MODE" <<'PY'
import json, os, subprocess, sys
work, out, mode = sys.argv[1:]
try:
    import jax
    device = [d.device_kind for d in jax.devices()]
except Exception as e:  # noqa: BLE001 - recorded, not raised: the steps say what failed
    device = f"no JAX device: {e}"
steps = {}
for line in open(os.path.join(work, "steps")):
    name, rc, ms, limit = line.split()
    log = open(os.path.join(work, f"{name}.log"), errors="replace").read()
    path = os.path.join(work, f"{name}.json")
    if os.path.exists(path):
        result = json.load(open(path))
    elif name == "tests":
        result = ([l for l in log.splitlines() if " passed" in l or " failed" in l or " error" in l] or [None])[-1]
    else:
        result = None
    skipped = rc == "skipped"
    steps[name] = {"rc": None if skipped else int(rc), "skipped": skipped, "seconds": round(int(ms) / 1000, 1),
                   "limit_s": int(limit), "timed_out": rc == "124", "tail": log[-2000:], "result": result}
record = {"mode": mode, "device": device, "steps": steps,
          "ok": all(s["rc"] == 0 or s["skipped"] for s in steps.values())}
with open(out, "w") as f:
    json.dump(record, f, indent=2)
print(json.dumps({k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in steps.items()}), "->", out)
sys.exit(0 if record["ok"] else 1)
PY
rc=$?
rm -rf "$WORK"
exit $rc
