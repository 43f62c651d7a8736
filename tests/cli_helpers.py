"""The `fastdpo` command run in the test's own process."""


def run_cli(capsys, *args) -> tuple[int, str]:
    """`fastdpo ARGS` in this process (fast); returns (exit code, everything printed)."""
    from fastdpo.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err
