"""The CLI frame through the real entry point: version, help, JSON, exit codes, no tracebacks."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_clean_error, tpurun
from tpurun import __version__
from tpurun.cli import COMMANDS, app, load_commands


def test_version():
    r = tpurun("--version")
    assert r.code == 0 and r.out.strip() == f"tpurun {__version__}"


def test_topology_json_v3_32():
    r = tpurun("topology", "v3-32", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert (d["hosts"], d["cores_per_host"], d["chips_per_host"]) == (4, 8, 4)


@pytest.mark.parametrize(
    "name,key,value",
    [("v4-32", "hosts", 4), ("v4-32", "pjrt_devices_per_host", 4), ("v5litepod-16", "hosts", 4), ("v2-8", "hosts", 1)],
)
def test_topology_json_values(name, key, value):
    r = tpurun("topology", name, "--json")
    assert json.loads(r.out)[key] == value


def test_topology_invalid_names_valid_sizes():
    r = tpurun("topology", "v3-33")
    assert_clean_error(r, 2)
    assert "8, 32, 64, 128, 256, 512, 1024, 2048" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_topology_plain_table():
    r = tpurun("--plain", "topology", "v4-16")
    assert r.code == 0 and "hosts (TPU VMs)" in r.out and "2" in r.out


def test_topology_list_json():
    r = tpurun("topology", "--list", "--json")
    names = [t["name"] for t in json.loads(r.out)]
    assert "v6e-256" in names and "v5p-12288" in names


def test_unknown_command_and_option_exit_2():
    for args in (["no-such-command"], ["topology", "--no-such-flag"], ["create"], ["train", "x.py", "--cores", "abc"]):
        r = tpurun(*args)
        assert_clean_error(r, 2)
        assert len(r.err.strip().splitlines()) == 1, r.err  # one line, even for the framework's own errors


def _command_paths():
    import typer.main

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        if name == "emulator":
            continue
        yield [name]
        for sub in getattr(cmd, "commands", {}):
            yield [name, sub]


def test_help_on_every_command():
    load_commands([])
    assert [p[0] for p in _command_paths() if len(p) == 1] == [n for n in COMMANDS if n != "emulator"]
    for path in _command_paths():
        r = tpurun(*path, "--help")
        assert r.code == 0, (path, r.err)
        assert "Usage" in r.out


def test_help_shows_line_tags_literally():
    """rich must not take [wN] in a help text for markup and swallow it."""
    r = tpurun("exec", "--help", env={"COLUMNS": "200"})
    assert "lines prefixed [wN]" in r.out, r.out


def test_config_show_json_sources(tmp_path):
    (tmp_path / "tpurun.toml").write_text('zone = "us-central2-b"\n')
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "TPURUN_PROJECT": "proj-env"}
    r = tpurun("config", "show", "--json", cwd=tmp_path, env=env)
    d = json.loads(r.out)
    assert d["project"] == {"value": "proj-env", "source": "env TPURUN_PROJECT"}
    assert d["zone"]["value"] == "us-central2-b" and d["zone"]["source"].endswith("tpurun.toml")
    r2 = tpurun("config", "show", "--json", "--zone", "europe-west4-a", cwd=tmp_path, env=env)
    assert json.loads(r2.out)["zone"] == {"value": "europe-west4-a", "source": "flag --zone"}


def test_malformed_toml_no_traceback(tmp_path):
    (tmp_path / "tpurun.toml").write_text("zone = [unclosed\n")
    r = tpurun("config", "show", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert_clean_error(r, 2)
    assert "tpurun.toml is not valid TOML" in r.err
