"""The ``jmsnas`` command: one sub-command per module under ``jmsnas/commands`` (each has add_parser/run)."""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module under jmsnas.commands exposing add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "latency": "latency",
    "split": "split",
    "search": "search",
    "retrain": "search",
    "evolve": "evolve",
    "profile": "profile",
    "modularize": "modular", "load": "modular", "finetune": "modular",
    "autosplit": "autosplit",
    "export": "deploy", "pipeline": "deploy", "worker": "deploy",
    "separable": "separable",
    "measure": "tables", "adapt": "tables", "validate": "tables",
    "plot": "plot",
}


def _available():
    found = {}
    for name, module in COMMANDS.items():
        found[name] = importlib.import_module(f"jmsnas.commands.{module}")
    return found


class _Parser(argparse.ArgumentParser):
    """argparse with the project's refusal: one line ``<prog>: error: <message>`` on stderr and exit code 2 (no
    usage block), for every sub-command's parser too."""

    def error(self, message):
        import re

        from jmsnas import safeio
        message = re.sub(r"^argument ([^:]+): must ", r"\1 must ", str(message))  # "--batch must be ..., got '0'"
        self.exit(2, f"{self.prog}: error: {safeio.clip(message, 600)}\n")


def _finite_floats(sub, args) -> None:
    """Every float flag finite (a NaN or infinity never reaches a command): the generic part of the boundary that
    a new flag inherits; ranges are each flag's own ``type=`` (``runcheck.number_flag``)."""
    import math
    for action in sub._actions:
        v = getattr(args, action.dest, None)
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, float) and not math.isfinite(x):
                sub.error(f"{'/'.join(action.option_strings) or action.dest} must be a finite number, got {x!r}")


CONFIG_REFERENCE = "docs/configuration.md"


def build_parser():
    """(the ``jmsnas`` parser, its sub-parsers' action): every sub-command with its flags (the documentation's tests
    check the commands and flags the docs show against it)."""
    parser = _Parser(prog="jmsnas", description=__doc__,
                     epilog=f"Every config key, its default, unit and meaning: {CONFIG_REFERENCE}")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every step anew (default: reuse executables from the persistent compilation "
                             "cache in $JMSNAS_CACHE_DIR, else $XDG_CACHE_HOME/jmsnas, else ~/.cache/jmsnas; also "
                             "JMSNAS_COMPILE_CACHE=0); accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in {id(m): m for m in _available().values()}.values():  # a module may serve several sub-commands
        mod.add_parser(sub)
    return parser, sub


def main(argv=None) -> int:
    """Run one command; its exit code (2 for bad input, with one line on stderr)."""
    try:
        return _main(argv)
    except SystemExit as e:  # argparse's refusal (2) or --help (0): a code, not an exception, for in-process callers
        return e.code if isinstance(e.code, int) else 2
    finally:
        from jmsnas.run import workdir
        workdir.release_workdirs()


def _main(argv=None) -> int:
    if not _host_settings():
        return 2
    parser, sub = build_parser()
    mods = _available()
    argv = list(sys.argv[1:] if argv is None else argv)
    no_cache = "--no-compile-cache" in argv
    args, extra = parser.parse_known_args([a for a in argv if a != "--no-compile-cache"])
    if not _compile_cache(not no_cache):
        return 2
    if extra and args.command not in ("search", "retrain", "evolve", "separable"):
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    _finite_floats(sub.choices[args.command], args)
    try:
        if args.command in ("search", "retrain", "evolve", "separable"):
            return mods[args.command].run(args, extra)
        return mods[args.command].run(args)
    except BrokenPipeError:
        return _closed_stdout()


def _closed_stdout() -> int:
    """The reader of stdout went away (``jmsnas split ... | head -2``): stop quietly, as Unix tools do, with
    128 + SIGPIPE, and keep Python from reporting the failed flush of stdout at exit."""
    import os
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


def _host_settings() -> bool:
    """The command's host-memory and dispatch settings (jmsnas.hostmem.apply), before any command module can start
    JAX; False on a bad JMSNAS_KEEP_FREED_MEMORY. A library import sets nothing: only the command does this."""
    from jmsnas import hostmem
    try:
        hostmem.apply()
    except ValueError as e:
        print(f"jmsnas: error: {e}", file=sys.stderr)
        return False
    return True


def _compile_cache(on: bool) -> bool:
    """Every command reuses compiled executables (jmsnas.cache) unless told not to; False on a bad setting."""
    from jmsnas import cache
    try:
        if on and cache.requested():
            cache.enable_compilation_cache()
    except ValueError as e:  # a bad JMSNAS_COMPILE_CACHE value
        print(f"jmsnas: error: {e}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
