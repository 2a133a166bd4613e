"""What tpurun sends from a project and what it leaves in one, on one emulated v4-16 (2 workers) the tests
share: `sync` and `train` say how much they send and warn above TPURUN_SYNC_WARN_MB with the line that
leaves the largest files out; `download` into a project is neither sent back by the next `train` nor seen by
git; `create` and `attach` write tpurun.toml where git does not see it, and sync never sends it."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, delete_every_tpu
from tests.integration.conftest import Cli, cli_env

pytestmark = pytest.mark.integration

NAME = "files"
LISTER = "import os\nprint(sorted(p for p in os.listdir('.') if p[0] != '.'))\n"  # what the job's directory holds


def _git(where: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _repo(where: Path) -> None:
    """A git repository at WHERE with one commit (its files so far) and nothing else to report."""
    where.mkdir(parents=True, exist_ok=True)
    _git(where, "init", "-q")
    _git(where, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "start")
    if any(p.name != ".git" for p in where.iterdir()):
        _git(where, "add", "-A")
        _git(where, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "files")
    assert _git(where, "status", "--porcelain") == ""


@pytest.fixture(scope="module")
def made(emulator, tmp_path_factory):
    """The shared TPU, made by `tpurun create` in a git repository: (its Cli, the repository)."""
    base = tmp_path_factory.mktemp("project-files")
    home = base / "home"
    home.mkdir()
    repo = base / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "lister.py").write_text(LISTER)
    _repo(repo)
    cli = Cli(repo / "src", home, cli_env(emulator, home), emulator)
    r = cli("create", NAME, "-t", "v4-16")
    try:
        assert r.code == 0, r.err
        yield cli, repo
    finally:
        delete_every_tpu(emulator)


def _project(made, name: str, *, warn_mb: str | None = None) -> Cli:
    """A project directory of its own (synced to ~/NAME) on the shared TPU, named through TPURUN_TPU."""
    cli, repo = made
    where = repo.parent / name
    where.mkdir()
    env = {**cli.env, "TPURUN_TPU": NAME}
    if warn_mb is not None:
        env["TPURUN_SYNC_WARN_MB"] = warn_mb
    return replace(cli, cwd=where, env=env)


def _on_worker(cli: Cli, worker: int, path: str) -> bool:
    """Whether PATH exists on WORKER."""
    r = cli("exec", "--worker", str(worker), "--", "test", "-e", path)
    assert r.code in (0, 1), r.err
    return r.code == 0


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_create_and_attach_leave_git_status_clean_and_tpurun_toml_at_home(made):
    cli, repo = made
    toml = repo / "src" / "tpurun.toml"
    assert toml.read_text() == f'tpu = "{NAME}"\n'  # create made it the default here...
    assert _git(repo, "status", "--porcelain") == ""  # ... and git does not see it
    assert "/src/tpurun.toml" in (repo / ".git" / "info" / "exclude").read_text().splitlines()
    r = cli("--plain", "sync")
    assert r.code == 0, r.err
    assert not _on_worker(cli, 1, "src/tpurun.toml") and _on_worker(cli, 1, "src/lister.py")  # never sent
    assert _git(repo, "status", "--porcelain") == ""
    # attach from a linked worktree of the repository: its exclude file is the repository's own
    tree = repo.parent / "linked"
    _git(repo, "worktree", "add", "-q", str(tree))
    (tree / "other").mkdir()
    r = replace(cli, cwd=tree / "other")("attach", NAME)
    assert r.code == 0, r.err
    assert (tree / "other" / "tpurun.toml").is_file()
    assert _git(tree, "status", "--porcelain") == "" and _git(repo, "status", "--porcelain") == ""
    # a tpurun.toml the user made stays theirs: git still shows it
    own = _project(made, "own")
    _repo(own.cwd)
    (own.cwd / "tpurun.toml").write_text('zone = "us-central2-b"\n')
    r = own("attach", NAME)
    assert r.code == 0, r.err
    assert (own.cwd / "tpurun.toml").read_text() == f'zone = "us-central2-b"\ntpu = "{NAME}"\n'
    assert _git(own.cwd, "status", "--porcelain") == "?? tpurun.toml\n"


def test_a_large_sync_says_how_much_and_how_to_leave_it_out(made):
    cli = _project(made, "big", warn_mb="2")
    (cli.cwd / "data").mkdir()
    (cli.cwd / "data" / "big.bin").write_bytes(os.urandom(3_000_000))
    (cli.cwd / "mid.bin").write_bytes(os.urandom(1_200_000))
    (cli.cwd / "lister.py").write_text(LISTER)
    r = cli("--plain", "sync")
    assert r.code == 0, r.err
    (warning,) = _warnings(r.err)
    assert warning.startswith(
        "warning: this sync sends 4.2 MB in 3 files to each worker, more than TPURUN_SYNC_WARN_MB=2 MB; "
        "the largest: data/big.bin (3.0 MB), mid.bin (1.2 MB). To leave them out of the next syncs and trains: "
    ), r.err
    assert f"synced {cli.cwd} to ~/big in " in r.err, r.err
    assert "s: 3 files (4.2 MB) sent to each of 2 workers, 0 unchanged" in r.err, r.err
    assert r.err.index("warning: ") < r.err.index("synced ")  # said before the data went
    # the line it gives, run as given, leaves those files out of the next sync
    command = warning.split("trains: ", 1)[1]
    subprocess.run(["sh", "-c", command], cwd=cli.cwd, check=True, timeout=30)
    assert (cli.cwd / ".tpurunignore").read_text() == "/data/big.bin\n/mid.bin\n"
    (cli.cwd / "note.txt").write_text("n\n")
    r = cli("--plain", "sync")
    assert r.code == 0 and not _warnings(r.err), r.err
    assert "s: 2 files (25 B) sent to each of 2 workers, 1 unchanged" in r.err, r.err
    # train's sync before the job: the same warning first, then the same line, for the new large file
    (cli.cwd / "huge.npy").write_bytes(os.urandom(2_500_000))
    r = cli("train", "lister.py", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    (warning,) = _warnings(r.err)
    assert "sends 2.5 MB in 1 file to each worker" in warning and "the largest: huge.npy (2.5 MB)" in warning
    assert warning.endswith("printf '%s\\n' /huge.npy >> .tpurunignore"), warning
    assert re.search(
        r"synced \S+ to ~/big in [\d.]+ s: 1 file \(2\.5 MB\) sent to each of 2 workers, 3 unchanged", r.err
    )
    # no warning at 0, and a limit that is no number refused before anything is sent
    (cli.cwd / "huge2.npy").write_bytes(os.urandom(2_500_000))
    r = replace(cli, env={**cli.env, "TPURUN_SYNC_WARN_MB": "lots"})("sync")
    assert_clean_error(r, 2)
    assert "TPURUN_SYNC_WARN_MB='lots' is not a size" in r.err, r.err
    assert not _on_worker(cli, 0, "big/huge2.npy")
    r = replace(cli, env={**cli.env, "TPURUN_SYNC_WARN_MB": "0"})("--plain", "sync")
    assert r.code == 0 and not _warnings(r.err) and _on_worker(cli, 0, "big/huge2.npy"), r.err


def test_downloaded_logs_stay_out_of_the_next_train_and_of_git(made):
    """The tour's `tpurun download ".tpurun/jobs/$JOB" logs` from a project, then another train from it."""
    cli = _project(made, "tour")
    (cli.cwd / "lister.py").write_text(LISTER)
    _repo(cli.cwd)
    r = cli("train", "lister.py", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    job = re.search(r"job (\S+):", r.err).group(1)
    r = cli("download", f".tpurun/jobs/{job}", "logs")
    assert r.code == 0, r.err
    assert (cli.cwd / "logs" / "w1" / job / "w1-c0.log").read_text().strip() == "['lister.py']"
    assert "logs/: made by this download, so git and `tpurun sync`/`train` leave it out" in r.err, r.err
    assert not _warnings(r.err)
    assert _git(cli.cwd, "status", "--porcelain") == ""
    r = cli("train", "lister.py", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    assert "s: 0 files (0 B) sent to each of 2 workers, 1 unchanged" in r.err, r.err
    assert sorted(r.out.splitlines()) == ["[w0/c0] ['lister.py']", "[w1/c0] ['lister.py']"], r.out  # no logs/
    assert not _on_worker(cli, 0, "tour/logs")
    # again into the same place: nothing new to say
    r = cli("download", f".tpurun/jobs/{job}", "logs")
    assert r.code == 0 and "made by this download" not in r.err and not _warnings(r.err), r.err
    # a file into this directory itself (the user's own): said, with the line that keeps it here
    r = cli("download", "--worker", "0", f".tpurun/jobs/{job}/w0-c0.log", ".")
    assert r.code == 0, r.err
    (warning,) = _warnings(r.err)
    assert warning == (
        "warning: w0-c0.log: in this directory, so the next `tpurun train` or `tpurun sync` from here sends it to "
        "every worker; to keep it here: printf '%s\\n' /w0-c0.log >> .tpurunignore"
    ), r.err
    subprocess.run(["sh", "-c", warning.split("here: ", 1)[1]], cwd=cli.cwd, check=True, timeout=30)
    r = cli("download", "--worker", "0", f".tpurun/jobs/{job}/w0-c0.log", ".")
    assert r.code == 0 and not _warnings(r.err), r.err
    # several workers into a directory of the user's: each worker's tree is made there, and left out
    (cli.cwd / "runs").mkdir()
    r = cli("download", f".tpurun/jobs/{job}", "runs")
    assert r.code == 0 and not _warnings(r.err), r.err
    assert "runs/w0/, runs/w1/: made by this download" in r.err, r.err
    assert sorted(p.name for p in (cli.cwd / "runs").iterdir()) == ["w0", "w1"]
    assert _git(cli.cwd, "status", "--porcelain") == "?? .tpurunignore\n?? w0-c0.log\n"
    # a tree that brings its own .gitignore keeps it (no mark over it), and is said to travel
    make = "mkdir -p own && echo '*.tmp' > own/.gitignore && echo x > own/a.txt"
    assert cli("exec", "--worker", "0", "--", "sh", "-c", make).code == 0
    r = cli("download", "--worker", "0", "own", ".")
    assert r.code == 0 and "made by this download" not in r.err, r.err
    (warning,) = _warnings(r.err)
    assert warning.startswith("warning: own: in this directory, so the next `tpurun train`"), r.err
    assert warning.endswith("printf '%s\\n' /own >> .tpurunignore"), r.err
    assert (cli.cwd / "own" / ".gitignore").read_text() == "*.tmp\n"
