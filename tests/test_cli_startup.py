"""`fastdpo --help`, every subcommand's --help and --version start without torch: the flag tables are built from
the config sections alone, and the command modules load torch only when a command runs."""

import json
import subprocess
import sys

COMMANDS = ["", "train", "check-data", "precompute-ref", "bench", "infer", "eval", "export", "tune", "demo", "plot",
            "verify", "env"]

PROBE = """
import contextlib, io, json, sys
import fastdpo.cli as cli
seen = {}
for command in json.loads(sys.argv[1]):
    sys.argv = ["fastdpo", *command.split(), "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main()
        except SystemExit as stop:
            code = stop.code
    seen[command or "fastdpo"] = {"code": code, "torch": "torch" in sys.modules, "printed": len(out.getvalue())}
sys.argv = ["fastdpo", "--version"]
with contextlib.redirect_stdout(io.StringIO()):
    try:
        cli.main()
    except SystemExit:
        pass
seen["--version"] = {"code": 0, "torch": "torch" in sys.modules, "printed": 1}
print(json.dumps(seen))
"""


def test_help_and_version_do_not_import_torch():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(COMMANDS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(seen) == {c or "fastdpo" for c in COMMANDS} | {"--version"}
    for command, result in seen.items():
        assert result["code"] in (0, None), (command, result)
        assert result["printed"] > 0, command
        assert not result["torch"], f"`{command} --help` imported torch"


def test_the_probe_would_see_torch():
    """The check above can fail: the same probe reports torch once something on the path imports it."""
    done = subprocess.run([sys.executable, "-c", "import torch\n" + PROBE, json.dumps([""])], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["fastdpo"]["torch"]
