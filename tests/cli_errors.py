"""The command line's refusals as the tests check them: exit status 2, one line on stderr, nothing written."""
import os

from jmsnas import cli


def cli_error(capsys, argv) -> str:
    """Runs ``jmsnas argv``; asserts exit status 2 and one line on stderr, and returns that line."""
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    return err


def refused_writing_nothing(capsys, tmp_path, command: str, args) -> str:
    """``jmsnas command --workdir W *args`` refused in one line both on a workdir holding a user's file (kept as
    it was, nothing added) and on a fresh path (not created); returns the line."""
    keep = tmp_path / "work"
    keep.mkdir()
    (keep / "precious.txt").write_text("keep me")
    err = cli_error(capsys, [command, "--workdir", str(keep), *args])
    assert (keep / "precious.txt").read_text() == "keep me"
    assert sorted(os.listdir(keep)) == ["precious.txt"]
    fresh = tmp_path / "fresh"
    assert cli_error(capsys, [command, "--workdir", str(fresh), *args]) == err
    assert not fresh.exists()
    return err
