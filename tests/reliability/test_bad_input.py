"""The bad-input corpus: every case gets its exit code (2, or the code the README lists), one line on stderr that
starts with `error:` (a `hint:` line may follow), no traceback, and the API sees no POST/PATCH/DELETE.

The cases run concurrently (one subprocess each) in a module fixture; each is then its own test.
NUL cannot be passed in argv at all (the kernel's strings are NUL-terminated, so no CLI case can carry
one); the places where a NUL could still arrive inside a value are checked directly at the end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import delete_every_tpu
from tests.reliability.conftest import create, no_mutations

pytestmark = pytest.mark.integration

N = "bi"  # the READY node the node-bound cases act on

# Usage errors found by the CLI framework itself (typer/click: missing argument, unknown option, a
# value of the wrong type): tpurun.cli.main turns them into the same one-line form; listed for the docs.
FRAMEWORK = {"timeout-not-number", "unknown-option", "exec-no-command", "train-cores-word"}

# (id, argv, expected exit code, a needle of the message, setup key)
CASES: list[tuple[str, list[str], int, str, str]] = [
    # create: names, types, versions, files, labels, flags
    ("create-upper", ["create", "Bad_Name", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-digit-first", ["create", "1abc", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-too-long", ["create", "a" * 70, "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-space", ["create", "a b", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-newline", ["create", "a\nb", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-quote", ["create", "a'b", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-non-ascii", ["create", "tpü", "-t", "v4-8"], 2, "invalid TPU name", ""),
    ("create-empty", ["create", "", "-t", "v4-8"], 2, "", ""),
    ("create-no-type", ["create", "ok"], 2, "give the TPU's type: --accelerator-type", ""),
    ("type-cores", ["create", "ok", "-t", "v3-33"], 2, "8, 32, 64", ""),
    ("type-gen", ["create", "ok", "-t", "v9-8"], 2, "unknown TPU generation", ""),
    ("type-garbage", ["create", "ok", "-t", "banana"], 2, "", ""),
    ("type-zero", ["create", "ok", "-t", "v4-0"], 2, "", ""),
    ("type-negative", ["create", "ok", "-t", "v4--8"], 2, "", ""),
    ("type-non-ascii", ["create", "ok", "-t", "v4-８"], 2, "", ""),
    ("startup-missing", ["create", "ok", "-t", "v4-8", "--startup-script", "/nonexistent.sh"], 2, "no such file", ""),
    ("startup-dir", ["create", "ok", "-t", "v4-8", "--startup-script", "adir"], 2, "", "dir"),
    ("startup-fifo", ["create", "ok", "-t", "v4-8", "--startup-script", "fifo"], 2, "", "fifo"),
    ("startup-not-utf8", ["create", "ok", "-t", "v4-8", "--startup-script", "latin1.sh"], 2, "", "latin1"),
    ("label-upper", ["create", "ok", "-t", "v4-8", "--label", "Bad=x"], 2, "invalid --label", ""),
    ("label-no-eq", ["create", "ok", "-t", "v4-8", "--label", "novalue"], 2, "--label", ""),
    ("spot-and-preemptible", ["create", "ok", "-t", "v4-8", "--spot", "--preemptible"], 2, "one of --spot", ""),
    ("data-ftp", ["create", "ok", "-t", "v4-8", "--data", "ftp://x=/y"], 2, "bad --data", ""),
    ("valid-until-no-queued", ["create", "ok", "-t", "v4-8", "--valid-until", "3h"], 2, "--queued", ""),
    ("timeout-not-number", ["create", "ok", "-t", "v4-8", "--timeout", "soon"], 2, "", ""),
    ("unknown-option", ["create", "ok", "-t", "v4-8", "--colour", "red"], 2, "", ""),
    ("create-semicolon", ["create", "a;b", "-t", "v4-8"], 2, "invalid TPU name", ""),
    (
        "create-tpu7x-through-tpu-api",
        ["create", "ok", "-t", "tpu7x-32", "--backend", "tpu-api"],
        2,
        "Cloud TPU API does not make tpu7x-32; Compute Engine does",
        "",
    ),
    ("type-tpu7x-bad-size", ["create", "ok", "-t", "tpu7x-12"], 2, "tpu7x-N counts TensorCores", ""),
    # node commands on names that are invalid or unknown (404 is an API answer: exit 3)
    ("describe-invalid", ["describe", "Bad_Name"], 2, "invalid TPU name", ""),
    ("describe-unknown", ["describe", "nosuchnode"], 3, "no TPU named", ""),
    ("delete-unknown", ["delete", "nosuchnode", "--yes"], 3, "no TPU named", ""),
    ("delete-invalid", ["delete", "a;rm -rf /", "--yes"], 2, "invalid TPU name", ""),
    ("stop-invalid", ["stop", "$(id)"], 2, "invalid TPU name", ""),
    ("start-unknown", ["start", "nosuchnode"], 3, "no TPU named", ""),
    ("attach-invalid", ["attach", "a\nb"], 2, "invalid TPU name", ""),
    ("attach-unknown", ["attach", "nosuchnode"], 3, "no TPU named", ""),
    ("topology-bad", ["topology", "v5-8"], 2, "", ""),
    # exec / ssh / sync: worker specs and missing commands
    ("exec-worker-range", ["exec", "--tpu", N, "--worker", "5", "--", "true"], 2, "--worker", ""),
    ("exec-worker-reversed", ["exec", "--tpu", N, "--worker", "1-0", "--", "true"], 2, "--worker", ""),
    ("exec-worker-word", ["exec", "--tpu", N, "--worker", "first", "--", "true"], 2, "--worker", ""),
    ("exec-worker-negative", ["exec", "--tpu", N, "--worker", "-1", "--", "true"], 2, "--worker", ""),
    ("exec-worker-non-ascii", ["exec", "--tpu", N, "--worker", "１", "--", "true"], 2, "--worker", ""),
    ("exec-no-command", ["exec", "--tpu", N], 2, "", ""),
    ("exec-tpu-and-local", ["exec", "--tpu", N, "--local", "--", "true"], 2, "one of --tpu and --local", ""),
    ("exec-tpu-invalid", ["exec", "--tpu", "Bad_Name", "--", "true"], 2, "invalid TPU name", ""),
    ("ssh-worker-range", ["ssh", "--tpu", N, "--worker", "9", "--", "true"], 2, "", ""),
    ("sync-missing-src", ["sync", "--tpu", N, "nope"], 2, "", ""),
    ("sync-src-is-file", ["sync", "--tpu", N, "afile.txt"], 2, "", "file"),
    ("sync-worker-range", ["sync", "--tpu", N, "--worker", "7"], 2, "--worker", ""),
    # train: scripts, cores, runtimes, env
    ("train-missing-script", ["train", "missing.py", "--tpu", N], 2, "no such script", ""),
    ("train-script-dir", ["train", "adir", "--tpu", N], 2, "no such script", "dir"),
    ("train-script-outside", ["train", "/etc/hostname", "--tpu", N], 2, "outside this directory", ""),
    ("train-cores-zero", ["train", "ok.py", "--tpu", N, "--cores", "0"], 2, "--cores", "ok"),
    ("train-cores-word", ["train", "ok.py", "--tpu", N, "--cores", "all8"], 2, "", "ok"),
    ("train-core-negative", ["train", "ok.py", "--tpu", N, "--core", "-1"], 2, "--core", "ok"),
    ("train-core-and-cores", ["train", "ok.py", "--tpu", N, "--cores", "2", "--core", "1"], 2, "one of", "ok"),
    ("train-runtime", ["train", "ok.py", "--tpu", N, "--runtime", "gpu"], 2, "--runtime", "ok"),
    ("train-precision", ["train", "ok.py", "--tpu", N, "--precision", "16"], 2, "--precision", "ok"),
    ("train-env-no-eq", ["train", "ok.py", "--tpu", N, "--env", "NOEQUALS"], 2, "--env", "ok"),
    ("train-env-empty-name", ["train", "ok.py", "--tpu", N, "--env", "=x"], 2, "--env", "ok"),
    ("train-env-digit-name", ["train", "ok.py", "--tpu", N, "--env", "1A=x"], 2, "--env", "ok"),
    ("train-env-space-name", ["train", "ok.py", "--tpu", N, "--env", "A B=x"], 2, "--env", "ok"),
    ("train-env-newline-name", ["train", "ok.py", "--tpu", N, "--env", "A\nB=x"], 2, "--env", "ok"),
    ("train-env-non-ascii-name", ["train", "ok.py", "--tpu", N, "--env", "ÄB=x"], 2, "--env", "ok"),
    ("train-env-quote-name", ["train", "ok.py", "--tpu", N, "--env", "A'=x"], 2, "--env", "ok"),
    ("train-max-restarts", ["train", "ok.py", "--tpu", N, "--max-restarts", "-1"], 2, "--max-restarts", "ok"),
    # jobs: unknown ids, ids that try to leave the jobs directory
    ("logs-unknown", ["logs", "no-such-job"], 2, "unknown job", ""),
    ("logs-traversal", ["logs", "../../etc/passwd"], 2, "unknown job", ""),
    ("logs-empty", ["logs", ""], 2, "unknown job", ""),
    ("cancel-unknown", ["cancel", "20990101-000000-dead"], 2, "unknown job", ""),
    ("cancel-newline", ["cancel", "a\nb"], 2, "unknown job", ""),
    # settings: malformed tpurun.toml (each in its own project directory)
    ("toml-syntax", ["list"], 2, "tpurun.toml", "toml:project = "),
    ("toml-type", ["list"], 2, "tpurun.toml", "toml:project = 42"),
    ("toml-not-utf8", ["list"], 2, "tpurun.toml", "toml-latin1"),
    ("toml-bad-tpu", ["exec", "--", "true"], 2, "invalid TPU name", 'toml:tpu = "Bad_Name"'),
    ("toml-bad-zone-type", ["list"], 2, "tpurun.toml", "toml:zone = [1]"),
]


def _setup(root, key: str) -> None:
    root.mkdir(parents=True)
    if key == "dir":
        (root / "adir").mkdir()
    elif key == "fifo":
        os.mkfifo(root / "fifo")
    elif key == "latin1":
        (root / "latin1.sh").write_bytes(b"#!/bin/sh\necho caf\xe9\n")
    elif key == "file":
        (root / "afile.txt").write_text("x\n")
    elif key == "ok":
        (root / "ok.py").write_text("print(1)\n")
    elif key.startswith("toml:"):
        (root / "tpurun.toml").write_text(key[5:] + "\n")
    elif key == "toml-latin1":
        (root / "tpurun.toml").write_bytes(b'project = "caf\xe9"\n')


@pytest.fixture(scope="module")
def results(emulator, tmp_path_factory):
    """Run every case once, concurrently; {id: (Result, mutating requests seen during the batch)}."""
    from tests.helpers import tpurun
    from tests.integration.conftest import Cli, cli_env

    base = tmp_path_factory.mktemp("bad-input")
    home = base / "home"
    home.mkdir()
    env = cli_env(emulator, home)
    node_dir = base / "node"
    node_dir.mkdir()
    create(Cli(node_dir, home, env), N, "v4-16")
    since = emulator.request_count()

    def one(case):
        cid, argv, _, _, key = case
        cwd = base / cid
        _setup(cwd, key)
        return cid, tpurun(*argv, cwd=cwd, env=env, timeout=120)

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            out = dict(pool.map(one, CASES))
        mutations = no_mutations(emulator, since)
        yield out, mutations
    finally:
        delete_every_tpu(emulator)


def test_corpus_size():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


def test_nothing_was_created_changed_or_deleted(results):
    _, mutations = results
    assert [m for m in mutations if not m["path"].endswith(":getGuestAttributes")] == [], mutations


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(results, case):
    cid, argv, code, needle, _ = case
    r = results[0][cid]
    assert r.code == code, (argv, r.code, r.out, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(("hint:", "warning:", "  "))]
    assert len(errors) == 1, (argv, r.err)  # one message (a hint line may follow)
    assert needle in r.err, (argv, r.err)
    if cid in FRAMEWORK:
        assert "--help" in r.err, r.err  # where to look for the right usage


def test_nul_cannot_cross_argv_and_is_refused_inside_values():
    """The OS cannot put NUL in argv (so no CLI case can carry one); where a NUL could arrive in a value
    (an --env value from a script, an argument list built in Python) tpurun refuses it as bad input."""
    import subprocess
    import sys

    from tpurun.errors import UsageError
    from tpurun.job.launcher import parse_env
    from tpurun.transport.ssh import wrap_command

    with pytest.raises(ValueError):
        subprocess.run([sys.executable, "-c", "pass", "a\0b"])
    with pytest.raises(UsageError):
        parse_env(["A=x\0y"])
    with pytest.raises(UsageError):
        wrap_command(["echo", "x\0y"])
