"""The ``jmsnas`` command: one sub-command per module under ``jmsnas/commands`` (each has add_parser/run)."""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module under jmsnas.commands exposing add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "latency": "latency",
    "split": "split",
}


def _available():
    found = {}
    for name, module in COMMANDS.items():
        found[name] = importlib.import_module(f"jmsnas.commands.{module}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jmsnas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mods = _available()
    for mod in mods.values():
        mod.add_parser(sub)
    args = parser.parse_args(argv)
    return mods[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
