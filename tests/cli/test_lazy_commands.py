"""`tpurun.cli.main` imports only the module of the command it runs: that map must stay true."""

import subprocess
import sys

import pytest

from tpurun.cli import COMMAND_MODULES

_CHECK = """
import sys, typer
from tpurun.cli import app, load_commands
load_commands([sys.argv[1]])
names = typer.main.get_command(app).commands
assert sys.argv[1] in names, sorted(names)
assert "tpurun.commands" not in sys.modules
print(",".join(sorted(m for m in sys.modules if m.startswith("tpurun.cli_"))))
"""


@pytest.mark.parametrize("name", sorted(COMMAND_MODULES))
def test_command_registered_by_its_module_alone(name):
    r = subprocess.run([sys.executable, "-c", _CHECK, name], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if COMMAND_MODULES[name] is None:
        assert r.stdout.strip() == ""


def test_everything_else_loads_every_command():
    code = (
        "import sys\nfrom tpurun.cli import load_commands\n"
        "for args in (['--help'], [], ['exce'], ['--plain', 'no-such-command']):\n"
        "    sys.modules.pop('tpurun.commands', None)\n"
        "    load_commands(args)\n"
        "    assert 'tpurun.commands' in sys.modules, args\n"
        "load_commands(['--version'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_version_imports_no_command_module():
    code = "import sys\nfrom tpurun.cli import main\nmain(['--version'])\nassert not [m for m in sys.modules if m.startswith('tpurun.cli_')]"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("tpurun "), r.stderr
