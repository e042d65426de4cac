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
    "export": "deploy", "pipeline": "deploy",
    "separable": "separable",
    "measure": "tables", "adapt": "tables", "validate": "tables",
}


def _available():
    found = {}
    for name, module in COMMANDS.items():
        found[name] = importlib.import_module(f"jmsnas.commands.{module}")
    return found


def main(argv=None) -> int:
    if not _host_settings():
        return 2
    parser = argparse.ArgumentParser(prog="jmsnas", description=__doc__)
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every step anew (default: reuse executables from the persistent compilation "
                             "cache in $JMSNAS_CACHE_DIR, else $XDG_CACHE_HOME/jmsnas, else ~/.cache/jmsnas; also "
                             "JMSNAS_COMPILE_CACHE=0); accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True)
    mods = _available()
    for mod in {id(m): m for m in mods.values()}.values():  # a module may serve several sub-commands
        mod.add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    no_cache = "--no-compile-cache" in argv
    args, extra = parser.parse_known_args([a for a in argv if a != "--no-compile-cache"])
    if not _compile_cache(not no_cache):
        return 2
    if extra and args.command not in ("search", "retrain", "evolve", "separable"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
