#!/usr/bin/env bash
# The README's first set-up step, `pip install -e .`, in a fresh virtual environment, for one or more git refs:
# wall time of the install, the bytes it adds to site-packages, the number of packages and any TensorFlow package.
#   bash benchmarks/bench_install.sh REF [REF ...]        e.g.  bash benchmarks/bench_install.sh 9947fb0 HEAD
# Each ref is exported with `git archive` into a temporary folder (so the measured tree is exactly the commit),
# then: python3 -m venv, pip upgraded, site-packages measured (du -sb), `pip install -q -e .` timed, measured again.
# pip's download/wheel cache is left as it is (run each ref once before timing it to compare warm caches).
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
for ref in "$@"; do
  tmp=$(mktemp -d)
  git -C "$repo" archive "$ref" | tar -x -C "$tmp/"
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  sp=$("$tmp/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  s0=$(du -sb "$sp" | cut -f1)
  t0=$(date +%s.%N)
  (cd "$tmp" && "$tmp/venv/bin/pip" install -q -e . >/dev/null 2>&1)
  t1=$(date +%s.%N)
  s1=$(du -sb "$sp" | cut -f1)
  n=$("$tmp/venv/bin/pip" list 2>/dev/null | tail -n +3 | wc -l)
  tf=$("$tmp/venv/bin/pip" list 2>/dev/null | grep -i '^tensorflow' | tr -s ' ' | paste -sd, - || true)
  python3 -c "print(f'$ref: install {$t1 - $t0:.1f} s, site-packages +{($s1 - $s0) / 1e6:.0f} MB, $n packages, tensorflow: ${tf:-none}, load average $(cut -d' ' -f1 /proc/loadavg)')"
  rm -rf "$tmp"
done
