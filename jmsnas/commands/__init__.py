"""The ``jmsnas`` subcommands, one module each (``add_parser`` and ``run``)."""
import sys


def fail(command: str, message) -> int:
    """Refuse a command's input: ``jmsnas COMMAND: error: MESSAGE`` as one line on stderr (every run of whitespace
    one space); returns 2, the exit code of bad input."""
    print(f"jmsnas {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
