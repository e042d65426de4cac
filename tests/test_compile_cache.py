"""jmsnas.cache (where compiled things live, the persistent compilation cache) and jmsnas.timing (compile vs run)."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jmsnas import cache, report, timing


def test_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("JMSNAS_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.root() == tmp_path / "own"
    assert cache.xla_dir() == tmp_path / "own" / "xla" and cache.native_dir() == tmp_path / "own" / "native"
    monkeypatch.delenv("JMSNAS_CACHE_DIR")
    assert cache.root() == tmp_path / "xdg" / "jmsnas"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.root() == tmp_path / "home" / ".cache" / "jmsnas"
    from jmsnas import native
    assert native.cache_dir() == cache.native_dir()  # the native kernels' cache sits beside the XLA one


def test_switch_values(monkeypatch):
    monkeypatch.delenv(cache.ENV_SWITCH, raising=False)
    assert cache.requested() is True  # on by default
    monkeypatch.setenv(cache.ENV_SWITCH, "0")
    assert cache.requested() is False
    monkeypatch.setenv(cache.ENV_SWITCH, "off")
    with pytest.raises(ValueError, match=r"JMSNAS_COMPILE_CACHE must be 0 .* got 'off'"):
        cache.requested()


def test_unwritable_directory_warns_and_stays_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache.enable_compilation_cache(blocker / "xla") is None


# One process: jit a function whose program depends on argv[1] (so concurrent runs share one key), print the
# result, the cache directory in use and the timer's summary.
_PROBE = """
import json, sys
from jmsnas import cache, timing
d = cache.enable_compilation_cache()
import jax, jax.numpy as jnp
with timing.measure() as t:
    f = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) * float(sys.argv[1])))
    y = float(f(jnp.arange(64.0).reshape(8, 8) / 64))
print(json.dumps({"y": y, "dir": d, "time": t.summary()}))
"""


def _probe(env, arg="3"):
    return subprocess.Popen([sys.executable, "-c", _PROBE, arg], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JMSNAS_CACHE_DIR=str(tmp_path / "root"), JAX_PLATFORMS="cpu", **extra)
    return env


def _done(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_the_executable_and_concurrent_writers_are_safe(tmp_path):
    env = _env(tmp_path)
    first = [_probe(env), _probe(env)]  # two processes compile and write the same entry at once
    runs = [_done(p) for p in first]
    assert all(r["dir"] == str(tmp_path / "root" / "xla") for r in runs)
    # started together, the slower one may already find the faster one's entry: at least one compiled, and each
    # either compiled or loaded the executable
    assert sum(r["time"]["cache_misses"] for r in runs) >= 1
    assert all(r["time"]["cache_misses"] + r["time"]["cache_hits"] >= 1 for r in runs)
    entries = list((tmp_path / "root" / "xla").glob("*-cache"))
    assert entries
    again = _done(_probe(env))
    assert again["time"]["cache_hits"] >= 1 and again["time"]["cache_misses"] == 0
    assert again["y"] == runs[0]["y"] == runs[1]["y"]
    assert sorted((tmp_path / "root" / "xla").glob("*-cache")) == sorted(entries)  # nothing new compiled
    off = _done(_probe(_env(tmp_path, JMSNAS_COMPILE_CACHE="0")))
    assert off["dir"] is None and off["time"]["cache_hits"] == 0


@pytest.mark.slow
def test_cli_flag_turns_the_cache_off(tmp_path):
    env = _env(tmp_path)
    args = [sys.executable, "-m", "jmsnas.cli", "split", "--model", "mobilenet_v2", "--topology", "chain",
            "--json"]
    # split runs no jitted step worth caching, but enabling the cache creates its directory
    on = subprocess.run(args, env=env, capture_output=True, text=True)
    off_env = _env(tmp_path / "off")
    off = subprocess.run(args[:3] + ["--no-compile-cache"] + args[3:], env=off_env, capture_output=True, text=True)
    assert on.returncode == off.returncode
    assert (tmp_path / "root" / "xla").is_dir()
    assert not (tmp_path / "off" / "root" / "xla").exists()
    bad = subprocess.run(args, env=_env(tmp_path, JMSNAS_COMPILE_CACHE="yes"), capture_output=True, text=True)
    assert bad.returncode == 2 and "JMSNAS_COMPILE_CACHE must be 0" in bad.stderr


class _Bar:
    """Records what a tqdm bar would show."""

    def __init__(self, desc):
        self.desc, self.disable, self.shown = desc, False, []

    def set_description(self, text):
        self.shown.append(text)


def test_timer_splits_compile_from_run_and_labels_the_bar():
    bar = _Bar("search")
    with timing.measure() as t:
        assert timing.active() is t
        with timing.measure() as inner:  # nested flows share the outer timer
            assert inner is t
        timing.label(bar)
        f = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) * 1.2345))  # a fresh program: traced, lowered, compiled
        x = jnp.arange(1000.0)
        f(x).block_until_ready()
        after_compile = t.summary()
        for _ in range(3):
            f(x).block_until_ready()  # cached in memory: no compile events
        s = t.summary()
    assert timing.active() is None and timing.summary() is None
    assert bar.shown[0] == "search (compiling)" and bar.shown[-1] == "search"
    assert s["compilations"] >= 1 and s["compilations"] == after_compile["compilations"]
    assert s["compile"] == after_compile["compile"]
    assert s["compile"]["wall_s"] > 0 and s["compile"]["cpu_s"] > 0
    for kind in ("wall_s", "cpu_s"):
        assert s["compile"][kind] + s["run"][kind] == pytest.approx(s["total"][kind], abs=2e-3)
    assert s["run"]["wall_s"] >= 0


def test_summary_reports_time():
    from test_report import _chain_result
    r = _chain_result()
    assert "Time:" not in report.format_summary(r)
    r["time"] = {"compile": {"wall_s": 30.5, "cpu_s": 41.0}, "run": {"wall_s": 12.25, "cpu_s": 20.0},
                 "total": {"wall_s": 42.75, "cpu_s": 61.0}, "compilations": 40, "cache_hits": 38,
                 "cache_misses": 2}
    text = report.format_summary(r)
    assert ("Time: 42.8 s wall (61.0 s CPU): compiling 30.5 s (41.0 s CPU, 38 of 40 executables from the "
            "compilation cache), running 12.2 s (20.0 s CPU)") in text


def _entries(d, sizes_times):
    """Write JAX-style entries ``k<i>-cache`` (with an ``-atime`` companion) of the given (bytes, seconds since the
    epoch) into ``d``; returns their names."""
    names = []
    for i, (size, t) in enumerate(sizes_times):
        entry = d / f"k{i}-cache"
        entry.write_bytes(b"x" * size)
        (d / f"k{i}-atime").write_bytes(b"t")
        os.utime(entry, (t, t))
        names.append(entry.name)
    return names


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 10_000)), max_size=8, unique_by=lambda e: e[1]),
       st.integers(0, 200))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_trim_deletes_the_least_recently_used_until_the_rest_fit(tmp_path_factory, sizes_times, max_bytes):
    d = tmp_path_factory.mktemp("xla")
    names = _entries(d, sizes_times)
    (d / "other-file").write_bytes(b"kept")
    deleted = cache.trim(d, max_bytes)
    # oracle: drop the k oldest, for the smallest k that leaves at most max_bytes
    by_age = sorted(range(len(names)), key=lambda i: sizes_times[i][1])
    k = next(k for k in range(len(names) + 1) if sum(sizes_times[i][0] for i in by_age[k:]) <= max_bytes)
    kept = {names[i] for i in by_age[k:]}
    assert {p.name for p in d.glob("*-cache")} == kept
    assert {p.name for p in d.glob("*-atime")} == {n.replace("-cache", "-atime") for n in kept}
    assert (d / "other-file").read_bytes() == b"kept"
    assert deleted == sum(sizes_times[i][0] for i in by_age[:k])


def test_turning_the_cache_on_trims_it_at_most_once_a_day_and_leaves_jax_s_own_bound_off(tmp_path, monkeypatch):
    d = tmp_path / "xla"
    d.mkdir()
    now = time.time()
    _entries(d, [(80, now - 100), (80, now - 50)])  # 160 bytes, the older one over the bound
    monkeypatch.setattr(cache, "MAX_BYTES", 100)
    max_size = jax.config.jax_compilation_cache_max_size
    assert cache.enable_compilation_cache(d) == str(d)
    assert jax.config.jax_compilation_cache_max_size == max_size  # no directory scan on every write
    assert sorted(p.name for p in d.glob("*-cache")) == ["k1-cache"]
    assert (d / cache.TRIM_STAMP).exists()
    _entries(d, [(80, now - 200)])  # over the bound again, but trimmed less than a day ago
    cache.enable_compilation_cache(d)
    assert len(list(d.glob("*-cache"))) == 2
    assert cache.trim_if_due(d, every_s=0.0) and sorted(p.name for p in d.glob("*-cache")) == ["k1-cache"]
