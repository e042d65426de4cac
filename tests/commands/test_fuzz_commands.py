"""Property tests at every command's boundary (issue 33): generated flags, configuration overrides, topology files,
network/arch/table/space files and damaged run folders. Every outcome is a success or one line on stderr with exit
code 2: never a traceback, another exit code or a signal; and nothing is written outside the command's workdir or
--out, whatever the generated device names.

Derandomized with a fixed budget (``BUDGET`` examples per command), so CI runs the same cases every time. The
commands run in-process (``cli.main``). Where a success would start the long part of a run (training, measuring,
the pipeline's processes), the test stops the command at that point (``_Started``): everything before it, which is
the boundary, runs for real."""
import contextlib
import io
import json
import os
import shutil
import string

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

import tinyrun
from jmsnas import cli, pipeline

BUDGET = 12
from paths import REPO
SETTINGS = settings(max_examples=BUDGET, derandomize=True, deadline=None, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


class _Started(BaseException):
    """Raised where a command that passed its boundary would start its long work (counts as a success)."""


def _start(*_a, **_k):
    raise _Started


def outcome(argv) -> tuple:
    """(exit code, stderr) of ``jmsnas argv`` in-process; fails on anything but 0, 2 with one line, or _Started."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main([str(a) for a in argv])
    except _Started:
        event("passed the boundary")
        return 0, ""
    except BaseException as e:  # noqa: BLE001 - the property: nothing escapes the command
        pytest.fail(f"jmsnas {argv}: raised {type(e).__name__}: {str(e)[:500]}")
    text = err.getvalue().strip()
    assert code in (0, 2), (argv, code, text[-2000:])
    event("success" if code == 0 else "refused: " + text.split(": error: ", 1)[-1][:40])
    if code == 2:
        assert len(text.splitlines()) == 1 and "Traceback" not in text and text.startswith("jmsnas"), (argv, text)
        assert len(text) < 2000, (argv, len(text))
    return code, text


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A folder for the generated files; every example's writes must stay inside its workdir / --out there."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def run(sandbox):
    return tinyrun.make(str(sandbox / "run"))


@pytest.fixture(autouse=True)
def stop_long_work(monkeypatch):
    """Stop commands at the start of their long work (see the module docstring)."""
    from jmsnas.cost import profile
    from jmsnas.modular import finetune
    from jmsnas.deploy import pipeline as deploy_pipeline
    from jmsnas.quant import autosplit
    from jmsnas.run import workdir as run_workdir
    monkeypatch.setattr(run_workdir, "claim_workdir", _start)  # search, retrain, evolve, separable, SplitNets
    monkeypatch.setattr(profile, "measure_table", _start)
    monkeypatch.setattr(deploy_pipeline, "run_pipeline", _start)
    monkeypatch.setattr(autosplit, "prepare", _start)
    monkeypatch.setattr(finetune, "train_last", _start)


def _write(folder, name, content) -> str:
    p = os.path.join(folder, name)
    with open(p, "w" if isinstance(content, str) else "wb") as f:
        f.write(content)
    return p


def _files(root):
    return {os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs}


# ----------------------------------------------------------------------------------- generated values

NAMES = st.one_of(st.sampled_from(["ue", "edge", "cloud", "cam left", "dev-1", "/abs/x", "../x", "../../y", "a/b",
                                   "..", ".", "", " x", "x" * 70, "ü", "a:b", "-n", ".h"]),
                  st.text(alphabet=string.ascii_letters + "./\\ -_:", min_size=1, max_size=12))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12))
JUNK = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
NUMBERS = st.one_of(st.integers(-5, 70000).map(str), st.sampled_from(["0", "-1", "nan", "inf", "1e400", "abc", "",
                                                                      "2.5", "1e-9", "99999999999999999999"]))


def flag(*valid):
    """A flag's value: one of ``valid``, else a generated number-like string."""
    return st.one_of(st.sampled_from(list(valid)), NUMBERS)


@st.composite
def flags(draw, **valid):
    """{"--flag": value}: every flag one of its valid values except at most one (or none), which is generated."""
    vals = {f"--{k.replace('_', '-')}": draw(st.sampled_from(v)) for k, v in valid.items()}
    bad = draw(st.sampled_from([None] + sorted(vals)))
    if bad:
        vals[bad] = draw(NUMBERS)
    return vals


def _argv(d: dict) -> list:
    return [x for k, v in d.items() for x in ([k, *v] if isinstance(v, list) else [k, v])]


@st.composite
def topologies(draw):
    """A topology file's mapping: mostly well-formed (devices with generated names, chain links), sometimes junk."""
    if draw(st.integers(0, 5)) == 0:
        return draw(JUNK)
    names = draw(st.lists(NAMES, min_size=1, max_size=4))
    dev = lambda n: {"name": n, "preset": draw(st.sampled_from(["raspberry_pi4", "server_v100", "nope"]))} \
        if draw(st.booleans()) else {"name": n, "gflops": draw(SCALARS | st.floats(0.1, 1e4)),
                                     "memory_mb": draw(st.floats(0.001, 1e6) | SCALARS)}
    d = {"devices": [dev(n) for n in names],
         "links": [{"src": a, "dst": b, "mbps": draw(st.floats(0.1, 1e4) | SCALARS)} for a, b in zip(names, names[1:])]}
    if draw(st.booleans()):
        d["layers_per_device"] = draw(st.lists(st.integers(-1, 300), min_size=len(names), max_size=len(names)) | JUNK)
    return d


def _topology_file(folder, d, draw_fmt) -> str:
    if draw_fmt == "json":
        return _write(folder, "topo.json", json.dumps(d, default=str))
    return _write(folder, "topo.yaml", yaml.safe_dump(d, allow_unicode=True))


OVERRIDES = st.lists(st.tuples(
    st.sampled_from(["seed", "val_fraction", "checkpoint_every", "eval_batch_size", "search.weight_lr", "search.arch_lr",
                     "search.tau_decay", "search.epochs", "search.batch_size", "search.penalty", "search.gate_mode",
                     "retrain.epochs", "image_size", "max_train", "space.stem_channels", "space.head_channels",
                     "space.device_channels", "layers_per_device", "t_const_ms", "dw_impl", "split", "dataset",
                     "shared_weights", "topology", "nokey", "search"]),
    st.one_of(NUMBERS, st.sampled_from(["[1, 2, 3, 4]", "[1000, 1, 1, 1]", "[]", "true", "x", "two_path", "auto",
                                        "mesh", "chain", "{a: 1}", "&a [*a]", "[" * 100]))), max_size=3)


# ----------------------------------------------------------------------------------- search, retrain, evolve, separable

@SETTINGS
@given(over=OVERRIDES, topo=st.none() | topologies(), fmt=st.sampled_from(["yaml", "json"]),
       resume=st.booleans(), tau=flag("0.97"))
def test_fuzz_search(sandbox, over, topo, fmt, resume, tau):
    work = os.path.join(sandbox, "search")
    os.makedirs(work, exist_ok=True)
    argv = ["search", "--workdir", os.path.join(work, "w"), "--no-progress"] + (["--resume"] if resume else [])
    argv += [f"--config.{k}={v}" for k, v in over] + [f"--config.search.tau_decay={tau}"]
    if topo is not None:
        argv.append(f"--config.topology={_topology_file(work, topo, fmt)}")
    outcome(argv)
    assert not os.path.exists(os.path.join(work, "w"))


@SETTINGS
@given(over=st.lists(st.tuples(st.sampled_from(["population", "generations", "epochs", "chunk", "evaluator",
                                                "fitness_examples", "mutate_prob", "parent_ratio", "nokey"]),
                               st.one_of(NUMBERS, st.sampled_from(["batched", "loop", "0.5", "2000000000"]))),
                     max_size=3), extra=OVERRIDES)
def test_fuzz_evolve(sandbox, over, extra):
    w = os.path.join(sandbox, "evolve")
    argv = ["evolve", "--workdir", w, "--no-progress"] + [f"--config.evolve.{k}={v}" for k, v in over]
    outcome(argv + [f"--config.{k}={v}" for k, v in extra])
    assert not os.path.exists(w)


@SETTINGS
@given(over=st.lists(st.tuples(st.sampled_from(["net.alpha", "net.num_groups", "net.num_levels", "net.float16",
                                                "search.rounds", "search.augment_shift", "search.finetune_steps",
                                                "seed", "nokey"]), NUMBERS), max_size=3),
       config=st.sampled_from([None, "g4a2", "g4a2:tiny", "tiny", "g9z", "g4a2:tyni"]))
def test_fuzz_separable(sandbox, over, config):
    w = os.path.join(sandbox, "separable")
    argv = ["separable", "--workdir", w, "--no-progress"] + [f"--config.{k}={v}" for k, v in over]
    if config:
        argv += ["--config", os.path.join(REPO, "experiments", "configs", f"separable.py:{config}")]
    outcome(argv)
    assert not os.path.exists(w)


# ----------------------------------------------------------------------------------- split, autosplit, latency

@SETTINGS
@given(topo=st.sampled_from(["chain", "mesh", "splitnets", "nope"]) | topologies(), fmt=st.sampled_from(["yaml", "json"]),
       model=st.sampled_from(["mobilenet_v2", "resnet50", "nope", "NETFILE"]), net=JUNK,
       f=flags(act_bits=["8", "32", "4"], weight_bits=["8", "16"], bandwidth=["10", "0.5", "1000"]))
def test_fuzz_split(sandbox, topo, fmt, model, net, f):
    work = os.path.join(sandbox, "split")
    os.makedirs(work, exist_ok=True)
    if not isinstance(topo, str):
        topo = _topology_file(work, topo, fmt)
    if model == "NETFILE":
        model = _write(work, "net.json", json.dumps(net, default=str))
    outcome(["split", "--model", model, "--topology", topo, "--methods", "edge_only", "neurosurgeon", "chain_dp"]
            + _argv(f))


@SETTINGS
@given(topo=st.sampled_from(["autosplit", "chain", "mesh", "CLUSTER", "nope"]) | topologies(),
       model=st.sampled_from(["mobilenet_v2", "RUN", "nope"]),
       f=flags(memory_mb=["8", "0.01", "64"], max_accuracy_drop=["0.01", "0", "1"], bandwidth=["3", "100"]),
       bits=st.sampled_from(["2,4,6,8,16", "8", "", "3,99", "a,b", "0", "-2"]),
       select=st.sampled_from(["val", "test", "train"]), parts=st.sampled_from([None, "new", "RUN/parts", "RUN"]))
def test_fuzz_autosplit(sandbox, run, topo, model, f, bits, select, parts):
    work = os.path.join(sandbox, "autosplit")
    os.makedirs(work, exist_ok=True)
    if topo == "CLUSTER":
        topo = os.path.join(os.path.dirname(tinyrun.__file__), "..", "experiments", "topologies", "pi_cluster4.yaml")
    elif not isinstance(topo, str):
        topo = _topology_file(work, topo, "yaml")
    before = tinyrun.digest(run)
    argv = ["autosplit", "--model", run if model == "RUN" else model, "--topology", topo, "--bits", bits,
            "--select-on", select] + _argv(f)
    if parts:
        argv += ["--write-parts", {"new": os.path.join(work, "parts"), "RUN/parts": os.path.join(run, "parts"),
                                   "RUN": run}[parts]]
    outcome(argv)
    assert tinyrun.digest(run) == before


@SETTINGS
@given(table=JUNK, arch=JUNK, raw=st.sampled_from([None, "a: 1\na: 2\n", "{", "\xff\xfe", "- - - - - - - x"]),
       res=st.none() | flag("224", "8"))
def test_fuzz_latency(sandbox, table, arch, raw, res):
    work = os.path.join(sandbox, "latency")
    os.makedirs(work, exist_ok=True)
    t = _write(work, "t.yaml", raw if raw is not None else yaml.safe_dump(table, allow_unicode=True))
    a = _write(work, "a.json", json.dumps(arch, default=str))
    outcome(["latency", "--table", t, "--arch", a] + (["--resolution", res] if res is not None else []))


# ----------------------------------------------------------------------------------- modularize, load, finetune

LOAD_MODEL = {"overhead_ms": 15.0, "per_array_ms": 0.3, "ms_per_mb": 6.0, "rmse_ms": 0.0, "samples": []}


@pytest.fixture(scope="module")
def kids(sandbox, run):
    """Children of the tiny run (modularized once), copied per example before they are damaged."""
    lm = _write(str(sandbox), "lm.json", json.dumps(LOAD_MODEL))
    out = os.path.join(sandbox, "kids")
    assert cli.main(["modularize", "--model", run, "--children", "2", "--out", out, "--load-model", lm,
                     "--no-progress"]) == 0
    return out


@SETTINGS
@given(children=st.sampled_from(["1", "2", "auto", "0", "-1", "x", "99", "1e3"]),
       strategy=st.sampled_from(["exact", "equal", "qlearning", "greedy"]), threads=st.none() | flag("2"),
       lm=st.sampled_from(["ok", "junk", "missing"]) , junk=JUNK, model=st.sampled_from(["RUN", "nope", "RUN/parts"]),
       out=st.sampled_from(["new", "RUN", "RUN/parts/x", "existing"]))
def test_fuzz_modularize(sandbox, run, children, strategy, threads, lm, junk, model, out):
    work = os.path.join(sandbox, "modularize")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    lm_path = {"ok": _write(work, "lm.json", json.dumps(LOAD_MODEL)), "junk": _write(work, "j.json", json.dumps(
        junk, default=str)), "missing": os.path.join(work, "none.json")}[lm]
    if strategy == "qlearning" and children not in ("0", "-1", "x", "99", "1e3"):
        strategy = "equal"  # its training takes seconds; the flag itself is covered by the other values
    out_path = {"new": os.path.join(work, "out"), "RUN": run, "RUN/parts/x": os.path.join(run, "parts", "x"),
                "existing": work}[out]
    before = tinyrun.digest(run)
    argv = ["modularize", "--model", run if model == "RUN" else os.path.join(run, "parts") if model == "RUN/parts"
            else model, "--children", children, "--strategy", strategy, "--out", out_path, "--load-model", lm_path,
            "--no-progress"] + (["--threads", threads] if threads is not None else [])
    outcome(argv)
    assert tinyrun.digest(run) == before


def _damage(folder, how, data):
    """Damage a copy of the children: the manifest replaced by generated JSON, a child file truncated or removed."""
    if how == "manifest":
        _write(folder, "manifest.json", json.dumps(data, default=str))
    elif how == "manifest-field":
        with open(os.path.join(folder, "manifest.json")) as f:
            m = json.load(f)
        m[sorted(m)[len(str(data)) % len(m)]] = data
        _write(folder, "manifest.json", json.dumps(m, default=str))
    elif how in ("truncate", "remove"):
        files = sorted(_files(folder) - {os.path.join(folder, "manifest.json")})
        victim = files[len(str(data)) % len(files)]
        os.truncate(victim, os.path.getsize(victim) // 2) if how == "truncate" else os.remove(victim)


@SETTINGS
@given(how=st.sampled_from(["none", "manifest", "manifest-field", "truncate", "remove"]), data=JUNK,
       f=flags(parallel=["1", "2"], batch=["1", "3"]), infer=st.booleans())
def test_fuzz_load(sandbox, kids, how, data, f, infer):
    d = os.path.join(sandbox, "load")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(kids, d)
    _damage(d, how, data)
    outcome(["load", d, "--no-progress"] + _argv(f) + (["--infer"] if infer else []))


@SETTINGS
@given(how=st.sampled_from(["manifest", "manifest-field", "truncate", "remove"]), data=JUNK,
       f=flags(steps=["1", "3"], lr=["0.001", "1"], batch=["8", "1"]))
def test_fuzz_finetune(sandbox, kids, how, data, f):
    d = os.path.join(sandbox, "finetune")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(kids, d)
    _damage(d, how, data)  # an undamaged run's fine-tuning is tests/commands/test_boundaries.py's and test_modular.py's
    outcome(["finetune", d] + _argv(f))


@pytest.mark.parametrize("run_config", [[1, 2], {}, {"dataset": "digits"}])
def test_finetune_on_a_damaged_run_config_is_one_line(sandbox, kids, run_config):
    """The fuzzer's manifest-field damage, pinned: a run_config that is not the run's configuration."""
    d = os.path.join(sandbox, "finetune-run-config")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(kids, d)
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    m["run_config"] = run_config
    _write(d, "manifest.json", json.dumps(m))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["finetune", d, "--steps", "1"])
    text = err.getvalue().strip()
    assert code == 2 and len(text.splitlines()) == 1 and "run_config is damaged" in text, text


# ----------------------------------------------------------------------------------- export, pipeline

def _damaged_run(sandbox, run, how, data, name):
    w = os.path.join(sandbox, name)
    shutil.rmtree(w, ignore_errors=True)
    shutil.copytree(run, w)
    target = {"result": "result.json", "parts": os.path.join("parts", "manifest.json")}.get(how)
    if target:
        _write(w, target, json.dumps(data, default=str))
    elif how == "npz":
        os.truncate(os.path.join(w, "parts", "ue.npz"), len(str(data)))
    elif how == "no-result":
        os.remove(os.path.join(w, "result.json"))
    return w


@SETTINGS
@given(how=st.sampled_from(["none", "result", "parts", "npz", "no-result"]), data=JUNK,
       out=st.sampled_from([None, "new", "RUN/parts", "RUN/checkpoints/x", "RUN", "file"]),
       f=flags(batch=["1", "2"]), platforms=st.sampled_from(["cpu", "cpu,cuda", "", "tpu,x", ","]))
def test_fuzz_export(sandbox, run, how, data, out, f, platforms):
    w = _damaged_run(sandbox, run, how, data, "export-run")
    before = {k: v for k, v in tinyrun.digest(w).items() if not k.startswith("export")}
    o = {None: None, "new": os.path.join(sandbox, "export-out"), "RUN/parts": os.path.join(w, "parts"),
         "RUN/checkpoints/x": os.path.join(w, "checkpoints", "x"), "RUN": w,
         "file": os.path.join(w, "result.json")}[out]
    outcome(["export", "--workdir", w, "--platforms", platforms] + _argv(f) + (["--out", o] if o else []))
    assert {k: v for k, v in tinyrun.digest(w).items() if not k.startswith("export")} == before


@SETTINGS
@given(how=st.sampled_from(["none", "result", "parts", "npz", "no-result"]), data=JUNK,
       f=flags(images=["2", "100"], bandwidth_scale=[["1"], ["1", "0.5"]], timeout=["10", "0.5"],
               base_port=["0", "65534", "20000"], window=["8", "1"]),
       compute=st.sampled_from(["host", "profile", "2", "0", "-1", "nan", "ue=2", "ue=x", "=", "zz"]),
       phase=st.sampled_from(["latency", "stream", "both"]))
def test_fuzz_pipeline(sandbox, run, how, data, f, compute, phase):
    w = _damaged_run(sandbox, run, how, data, "pipeline-run")
    outcome(["pipeline", "--workdir", w, "--compute-scale", compute, "--phase", phase] + _argv(f))


# ----------------------------------------------------------------------------------- profile

@SETTINGS
@given(space=st.sampled_from(["default", "mesh", "FILE", "PY", "nope"]), fields=st.dictionaries(
    st.sampled_from(["topology", "layers_per_device", "image_size", "in_channels", "num_classes", "device_channels",
                     "device_strides", "stem_channels", "head_channels", "bogus"]), JUNK, max_size=5),
    topo=topologies(), f=flags(reps=["3", "50"], batch=["1", "2"], quantile=["0.5", "0.1"]),
    out=st.sampled_from(["ok", "nodir", "dir"]))
def test_fuzz_profile(sandbox, space, fields, topo, f, out):
    work = os.path.join(sandbox, "profile")
    os.makedirs(work, exist_ok=True)
    if space == "FILE":
        d = {"image_size": 8, "in_channels": 1, "num_classes": 10, "device_channels": [8, 8, 8, 8],
             "device_strides": [1, 2, 1, 2], **fields}
        if "topology" in fields and isinstance(fields["topology"], dict):
            d["topology"] = _topology_file(work, topo, "yaml")
        space = _write(work, "space.yaml", yaml.safe_dump(d, allow_unicode=True))
    elif space == "PY":
        space = _write(work, "cfg.py", "def get_config():\n    return 1 / 0\n")
    o = {"ok": os.path.join(work, "t.yaml"), "nodir": os.path.join(work, "no", "t.yaml"), "dir": work}[out]
    outcome(["profile", "--space", space, "--out", o] + _argv(f))


# ----------------------------------------------------------------------------------- no write outside

@settings(max_examples=8, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(names=st.lists(NAMES, min_size=2, max_size=3, unique=True))
def test_no_command_writes_outside_its_workdir_or_out(tmp_path_factory, names):
    """For generated device names: a search with them is refused before anything is written, or the names are
    safe, and then the main job's parts writer and `jmsnas export` (both real) write only inside the run's parts/
    and --out; nothing appears anywhere else (absolute names are placed inside the sandbox to be seen)."""
    box = str(tmp_path_factory.mktemp("box"))
    names = [n.replace("/abs", box + "/abs") for n in names]
    topo = {"devices": [{"name": n, "preset": "raspberry_pi4"} for n in names],
            "links": [{"src": a, "dst": b, "mbps": 10} for a, b in zip(names, names[1:])],
            "layers_per_device": [1] * len(names)}
    tfile = _write(box, "topo.yaml", yaml.safe_dump(topo, allow_unicode=True))
    w, out = os.path.join(box, "w"), os.path.join(box, "out")
    cwd = os.getcwd()
    os.chdir(box)  # relative names resolve inside the sandbox too
    try:
        code, _ = outcome(["search", "--workdir", w, f"--config.topology={tfile}", "--no-progress"])
        if code == 0:  # passed the boundary (stopped at the claim): the names are safe; write a run with them
            _write_run(w, tfile)
            outcome(["export", "--workdir", w, "--out", out])
    finally:
        os.chdir(cwd)
    stray = {p for p in _files(box) if not (p.startswith(w + os.sep) or p.startswith(out + os.sep)) and p != tfile}
    assert not stray, (names, stray)
    for n in names:
        if os.path.isabs(n):
            assert not os.path.lexists(n + ".npz") and not os.path.lexists(n + ".jaxexport"), n


def _write_run(workdir, topology_file):
    """A tiny run on the topology file's devices, through the main job's writers (parts/, result.json)."""
    from jmsnas import configs
    cfg = configs.tiny(configs.default_config())
    cfg.topology = topology_file
    space, _ = pipeline.build(cfg, pipeline.load_data(cfg))
    rng = np.random.default_rng(0)
    ops = tuple(int(np.flatnonzero(m)[0]) for m in space.mask())
    import jax
    from jmsnas import ops as O
    from jmsnas.space import OPS
    key = jax.random.PRNGKey(0)
    shapes = lambda: ({"stem": O.conv_bn_init(key, 3, space.in_channels, space.stem_channels),
                       "head": O.head_init(key, space.layers[-1].out_ch, space.head_channels, space.num_classes),
                       "layers": [O.op_init(key, OPS[i], s.in_ch, s.out_ch) for i, s in zip(ops, space.layers)]})
    t = jax.tree_util.tree_map(lambda a: rng.normal(0, 0.3, a.shape).astype(np.float32), jax.eval_shape(shapes))
    cp = {"stem": t["stem"][0], "head": t["head"][0], "layers": tuple(p for p, _ in t["layers"])}
    cs = jax.tree_util.tree_map(np.abs, {"stem": t["stem"][1], "head": t["head"][1],
                                         "layers": tuple(s for _, s in t["layers"])})
    os.makedirs(workdir, exist_ok=True)
    pipeline.write_parts(space, cp, cs, ops, workdir)
    _write(workdir, "result.json", json.dumps({"dataset": "digits", "seed": 0, "architecture": []}))
