"""Settings precedence: flag > env > tpurun.toml (cwd or parent) > user config > gcloud, each alone and each pair."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tpurun import settings
from tpurun.errors import UsageError

SOURCES = ["flag", "env", "project", "user", "gcloud"]  # highest first


def _setup(tmp_path: Path, active: list[str]) -> tuple[dict, dict, Path]:
    home = tmp_path / "home"
    xdg = home / ".config"
    work = tmp_path / "repo" / "sub" / "dir"
    work.mkdir(parents=True)
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(xdg)}
    flags: dict[str, str | None] = {}
    for src in active:
        if src == "flag":
            flags = {"project": "p-flag", "zone": "z-flag"}
        elif src == "env":
            env.update({"TPURUN_PROJECT": "p-env", "TPURUN_ZONE": "z-env"})
        elif src == "project":
            # in a parent of the cwd: found by walking up
            (tmp_path / "repo" / "tpurun.toml").write_text('project = "p-project"\nzone = "z-project"\n')
        elif src == "user":
            (xdg / "tpurun").mkdir(parents=True, exist_ok=True)
            (xdg / "tpurun" / "config.toml").write_text('project = "p-user"\nzone = "z-user"\n')
        elif src == "gcloud":
            gc = xdg / "gcloud"
            (gc / "configurations").mkdir(parents=True, exist_ok=True)
            (gc / "active_config").write_text("work\n")
            (gc / "configurations" / "config_work").write_text(
                "[core]\nproject = p-gcloud\n\n[compute]\nzone = z-gcloud\n"
            )
    return flags, env, work


CASES = [[s] for s in SOURCES] + [list(p) for p in itertools.combinations(SOURCES, 2)]


@pytest.mark.parametrize("active", CASES, ids=lambda a: "+".join(a))
def test_precedence(tmp_path, active):
    flags, env, cwd = _setup(tmp_path, active)
    s = settings.resolve(flags, env=env, cwd=cwd)
    winner = min(active, key=SOURCES.index)
    assert s.project.value == f"p-{winner}"
    assert s.zone.value == f"z-{winner}"
    expected_source = {
        "flag": "flag --project",
        "env": "env TPURUN_PROJECT",
        "project": str(tmp_path / "repo" / "tpurun.toml"),
        "user": str(tmp_path / "home" / ".config" / "tpurun" / "config.toml"),
        "gcloud": "gcloud " + str(tmp_path / "home" / ".config" / "gcloud" / "configurations" / "config_work"),
    }[winner]
    assert s.project.source == expected_source
    assert s.require_location() == (f"p-{winner}", f"z-{winner}")


def test_nothing_configured_names_every_place(tmp_path):
    _, env, cwd = _setup(tmp_path, [])
    s = settings.resolve({}, env=env, cwd=cwd)
    with pytest.raises(UsageError) as exc:
        s.require_location()
    msg = str(exc.value)
    for place in ("--project", "TPURUN_ZONE", "tpurun.toml", "config.toml", "gcloud"):
        assert place in msg


def test_malformed_toml_is_a_usage_error(tmp_path):
    (tmp_path / "tpurun.toml").write_text('project = "unterminated\n')
    with pytest.raises(UsageError) as exc:
        settings.resolve({}, env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert "tpurun.toml is not valid TOML" in str(exc.value)


def test_wrong_type_in_toml(tmp_path):
    (tmp_path / "tpurun.toml").write_text("zone = 3\n")
    with pytest.raises(UsageError, match="must be a string"):
        settings.resolve({}, env={"HOME": str(tmp_path)}, cwd=tmp_path)


def test_tpu_endpoint_and_home(tmp_path):
    env = {"HOME": str(tmp_path), "TPURUN_API_ENDPOINT": "http://127.0.0.1:9", "TPURUN_HOME": str(tmp_path / "h")}
    (tmp_path / "tpurun.toml").write_text('tpu = "demo"\n')
    s = settings.resolve({}, env=env, cwd=tmp_path)
    assert (s.tpu.value, s.api_endpoint.value, s.home.value) == ("demo", "http://127.0.0.1:9", str(tmp_path / "h"))
    s2 = settings.resolve({}, env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert s2.home.value == str(tmp_path / ".config" / "tpurun") and s2.endpoint == settings.DEFAULT_ENDPOINT


def test_write_project_setting_keeps_other_lines(tmp_path):
    p = tmp_path / "tpurun.toml"
    p.write_text('# mine\nzone = "z"\n\n[train]\ncores = 8\n')
    settings.write_project_setting("tpu", "demo", tmp_path)
    settings.write_project_setting("zone", "z2", tmp_path)
    text = p.read_text()
    assert "# mine" in text and "[train]" in text
    s = settings.resolve({}, env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert (s.tpu.value, s.zone.value) == ("demo", "z2")


def test_clearing_a_default_keeps_the_rest_of_the_file_or_removes_an_empty_one(tmp_path):
    toml = tmp_path / "tpurun.toml"
    toml.write_text('# mine\nzone = "us-central2-b"\ntpu = "demo"\n')
    assert settings.clear_project_setting("tpu", "other", tmp_path) is None  # names another node: untouched
    assert settings.clear_project_setting("tpu", "demo", tmp_path) == toml
    assert toml.read_text() == '# mine\nzone = "us-central2-b"\n'
    toml.write_text('tpu = "demo"\n')
    assert settings.clear_project_setting("tpu", "demo", tmp_path) == toml and not toml.exists()
