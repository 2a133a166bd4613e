"""Before a job: the versions a worker's agent reports (read from the .dist-info names its Python would
import from, in that Python, 3.8 too), the requirements' names, and the skew between workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import PY38
from tpurun.job import preflight
from tpurun.worker import WORKER_DIR, protocol, protocol_calls

PYTHONS = [sys.executable] + ([PY38] if PY38 else [])


def agent_versions(python: str, path: list[Path], names: list[str]) -> dict:
    """versions.installed(NAMES) in PYTHON, run as the agent runs it (the bundle's directory first), with
    PATH first on its sys.path."""
    code = (
        "import json, sys; sys.path[:0] = json.loads(sys.argv[2]); sys.path.insert(0, sys.argv[1]); import versions; "
        "print(json.dumps(versions.installed(json.loads(sys.argv[3]))))"
    )
    r = subprocess.run(
        [python, "-c", code, str(WORKER_DIR), json.dumps([str(p) for p in path]), json.dumps(names)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout)


@pytest.mark.parametrize("python", PYTHONS)
def test_versions_come_from_the_first_dist_info_on_the_path(tmp_path: Path, python: str) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for d in ("jax-0.4.30.dist-info", "Torch_XLA-2.9.0.dist-info", "libtpu_nightly-0.1.dev2024-py3.10.egg-info"):
        (first / d).mkdir(parents=True)
    (second / "jax-0.4.1.dist-info").mkdir(parents=True)  # shadowed, as an import would be
    (second / "jaxlib-0.4.30.dist-info").mkdir(parents=True)
    (second / "jaxlib.py").write_text("")  # not a distribution's metadata
    got = agent_versions(python, [first, second], ["jax", "jaxlib", "torch-xla", "libtpu-nightly", "absent"])
    assert got == {
        "jax": "0.4.30",
        "jaxlib": "0.4.30",
        "torch-xla": "2.9.0",
        "libtpu-nightly": "0.1.dev2024",
        "absent": None,
    }


def test_the_agent_reports_what_its_python_imports() -> None:
    from importlib.metadata import version  # what this venv has installed, by the standard library's reckoning

    r = subprocess.run(
        [sys.executable, str(WORKER_DIR / "agent.py"), "preflight", "--packages", "pathspec,no-such-thing"],
        capture_output=True,
        text=True,
        env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    answer = protocol_calls.Preflight.from_json(r.stdout)
    assert answer.jobs == []
    assert answer.python == ".".join(str(n) for n in sys.version_info[:3])
    assert answer.packages["pathspec"] == version("pathspec")
    assert answer.packages["no-such-thing"] is None
    assert answer.packages["torch_xla"] == version("torch_xla")
    assert set(answer.packages) >= {"jax", "jaxlib", "libtpu", "torch", "torch_xla", "torch_tpu"}


def test_requirement_names(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "requirements.txt").write_text(
        "# pins\nnumpy==1.26.4\n-r other.txt\n--index-url https://x\nflax[all]>=0.8 ; python_version>'3.9'\n"
        "git+https://github.com/a/b\n  optax  # inline\nnumpy\n"
    )
    assert preflight.requirement_names("sub/train.py", tmp_path) == ["numpy", "flax", "optax"]
    assert preflight.requirement_names("train.py", tmp_path) == []


def answer(python: str = "3.11.7", **packages: str | None) -> protocol_calls.Preflight:
    return protocol_calls.Preflight([], python, "/usr/bin/python3", packages)


TARGET = SimpleNamespace(name="pod", all_workers=[SimpleNamespace(name=f"w{i}") for i in range(4)])


def test_skew_names_the_odd_worker_and_the_common_version_first() -> None:
    same = {w: answer(jax="0.4.30", torch=None) for w in range(4)}
    assert not preflight.compare(TARGET, same)  # type: ignore[arg-type]
    skewed = {**same, 2: answer(jax="0.4.29", torch=None), 3: answer("3.10.12", jax="0.4.30", torch="2.9.0")}
    skew = preflight.compare(TARGET, skewed)  # type: ignore[arg-type]
    assert skew.rows == (
        ("python", "3.11.7", ("w0", "w1", "w2")),
        ("python", "3.10.12", ("w3",)),
        ("jax", "0.4.30", ("w0", "w1", "w3")),
        ("jax", "0.4.29", ("w2",)),
        ("torch", preflight.NOT_INSTALLED, ("w0", "w1", "w2")),
        ("torch", "2.9.0", ("w3",)),
    )
    assert skew.summary() == (
        "python 3.10.12 on w3 (3.11.7 elsewhere); jax 0.4.29 on w2 (0.4.30 elsewhere); "
        "torch 2.9.0 on w3 (not installed elsewhere)"
    )
    with pytest.raises(preflight.VersionSkew) as e:
        preflight.refuse_skew(TARGET, skew, allow=False)  # type: ignore[arg-type]
    assert e.value.exit_code == 2 and e.value.skew is skew
    assert "the workers of pod differ: python 3.10.12 on w3" in e.value.message
    preflight.refuse_skew(TARGET, skew, allow=True)  # type: ignore[arg-type]


def test_the_preflight_answer_round_trips() -> None:
    a = protocol_calls.Preflight(
        [protocol.JobState("j", 1, protocol.JobStatus.RUNNING)], "3.8.18", "/p", {"jax": "0.4.30", "x": None}
    )
    assert protocol_calls.Preflight.from_json(a.to_json()) == a
    with pytest.raises(ValueError):
        protocol_calls.Preflight.from_json('{"jobs": []}')
