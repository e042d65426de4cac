"""The composed search against the main job, both end to end (`jmsnas search`, stage 1 + repair + stage 2 +
report), interleaved: main, composed, main, composed, ... and the median ratio of their times.

    python benchmarks/bench_compose_search.py [--reps 3] [--out /tmp/bench_compose_search] [--split-searched]

The main job: `jmsnas search --config experiments/configs/default.py`. The composed search: the same with
`--config.compose.modules=[2,4,8] --config.compose.weight_bits=[4,6,8,32] --config.compose.activation_bits=[4,6,8,32]`
(the same epochs, batch and data); with ``--split-searched`` also `--config.split=searched
--config.compose.send_input=True` (the split searched, the input image sendable: the composed search of
experiments/composed.py). Each run is a fresh process; JAX's persistent compilation cache (the jmsnas
default) is warm for both from the second repetition on, so the first repetition is reported apart (it holds the
composed search's first compilation). Times are the runs' own result.json `time` (wall and CPU, compile and run).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

COMPOSED = ["--config.compose.modules=[2,4,8]", "--config.compose.weight_bits=[4,6,8,32]",
            "--config.compose.activation_bits=[4,6,8,32]"]


def run(workdir: str, extra: list) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "jmsnas.cli", "search", "--config", "experiments/configs/default.py", "--workdir",
           workdir, "--no-progress", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, "result.json")) as f:
        r = json.load(f)
    return {"wall_s": r["time"]["total"]["wall_s"], "cpu_s": r["time"]["total"]["cpu_s"],
            "compile_wall_s": r["time"]["compile"]["wall_s"], "test": r["accuracy"]["test"],
            "T_ms": r["latency_ms"]["total"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_compose_search")
    ap.add_argument("--split-searched", action="store_true", help="the composed search also searches the split and "
                    "may send the input")
    args = ap.parse_args()
    composed = COMPOSED + ["--config.split=searched", "--config.compose.send_input=True"] * args.split_searched
    rows = []
    for rep in range(args.reps):
        load = os.getloadavg()[0]
        main_t = run(os.path.join(args.out, "main"), [])
        comp_t = run(os.path.join(args.out, "composed"), composed)
        rows.append((main_t, comp_t))
        print(f"rep {rep}: load {load:.1f} -> {os.getloadavg()[0]:.1f}; main {main_t}; composed {comp_t}; "
              f"wall ratio {comp_t['wall_s'] / main_t['wall_s']:.2f}, cpu ratio {comp_t['cpu_s'] / main_t['cpu_s']:.2f}",
              flush=True)
    warm = rows[1:] or rows
    for key in ("wall_s", "cpu_s"):
        ratios = [c[key] / m[key] for m, c in warm]
        print(f"median {key} ratio composed / main over {len(warm)} repetition(s)"
              f"{' after the first' if len(rows) > 1 else ''}: {statistics.median(ratios):.2f} "
              f"(each: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
