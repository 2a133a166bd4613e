"""`tpurun.cli.main` imports only the module of the command it runs: COMMANDS must stay true."""

import subprocess
import sys

import pytest

from tpurun.cli import COMMANDS

_CHECK = """
import sys, typer
from tpurun.cli import app, load_commands
load_commands([sys.argv[1]])
names = typer.main.get_command(app).commands
assert list(names) == [sys.argv[1]], sorted(names)
print(",".join(sorted(m for m in sys.modules if m.startswith("tpurun.cli."))))
"""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_registered_by_its_module_alone(name):
    r = subprocess.run([sys.executable, "-c", _CHECK, name], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    module = "tpurun.cli." + COMMANDS[name].partition(":")[0]
    assert module in r.stdout.strip().split(","), r.stdout
    others = {"tpurun.cli." + v.partition(":")[0] for v in COMMANDS.values()} - {module}
    assert not others & set(r.stdout.strip().split(",")), r.stdout


def test_everything_else_loads_every_command_in_the_table_order():
    code = (
        "import sys, typer\nfrom tpurun.cli import COMMANDS, app, load_commands\n"
        "load_commands(['--plain', 'no-such-command'])\n"
        "assert list(typer.main.get_command(app).commands) == list(COMMANDS), list(typer.main.get_command(app).commands)\n"
    )
    for args in (["--help"], [], ["exce"]):
        r = subprocess.run(
            [sys.executable, "-c", code.replace("['--plain', 'no-such-command']", repr(args))],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, (args, r.stderr)


def test_version_imports_no_command_module():
    code = "import sys\nfrom tpurun.cli import main\nmain(['--version'])\nassert not [m for m in sys.modules if m.startswith('tpurun.cli.')]"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("tpurun "), r.stderr


def test_every_command_name_is_written_once_in_the_package():
    """The table is the one place: no command module registers a command by name (the emulator's own
    subcommands belong to its own app)."""
    from pathlib import Path

    import tpurun.cli

    for path in Path(tpurun.cli.__file__).parent.glob("*.py"):
        assert "@app.command" not in path.read_text(), path


@pytest.mark.parametrize("name", ["exec", "ssh", "sync", "train", "jobs", "logs", "cancel", "kill-stale", "doctor"])
def test_data_plane_commands_never_load_the_cloud_client(name):
    """google.cloud.tpu_v2 costs ~0.3 s of start-up: only commands that talk to the API may import it
    (a node's workers come from tpurun's remembered endpoints; docs/benchmarks.md)."""
    code = (
        "import sys\nfrom tpurun.cli import load_commands\n"
        f"load_commands([{name!r}])\nassert 'google.cloud.tpu_v2' not in sys.modules\n"
        "assert sys.modules.get('invoke') is None  # paramiko without invoke (transport/_paramiko.py)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_emulators_commands_load_none_of_its_server():
    """`tpurun emulator status` and the fault commands talk to a running emulator through its admin client: the
    server's modules (its state, Compute Engine's types: two seconds of CPU to import) stay unloaded."""
    code = (
        "import sys\nimport tpurun.emulator.cli\n"
        "loaded = [m for m in ('tpurun.emulator.api', 'tpurun.emulator.state', 'google.cloud.compute_v1')"
        " if m in sys.modules]\nassert not loaded, loaded\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
