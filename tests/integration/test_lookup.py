"""How a command finds the TPU it is given, by the real CLI against the emulator: a TPU tpurun made in another
zone than this place's default is found there (and named with its zone and the flag to use when a zone was chosen),
`list` says tpurun knows TPUs in other zones; the TPU's name first (`exec NAME -- CMD`, `ssh NAME`) is understood
or refused with the right form; a TPU that is gone is reported in one wording by every command, with a hint that
fits it; a TPU that does not exist is reported without importing Compute Engine's client.

One project directory and two TPUs for the whole file: `demo` (a Cloud TPU node in this place's default zone,
set in tpurun.toml, not in the environment) and `one` (a Compute Engine TPU7x VM in another zone)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.helpers import Result, assert_clean_error, create_node, delete_every_tpu, tpurun
from tests.integration.conftest import Cli
from tpurun.emulator.pytest_plugin import fast_polling

pytestmark = pytest.mark.integration

FAR = "us-central1-c"  # where `one` is: not this place's default zone
FORM = "`tpurun exec --tpu NAME -- CMD`"


@pytest.fixture(scope="module")
def place(emulator, tmp_path_factory) -> Iterator[Cli]:
    """The project directory: its zone in tpurun.toml (TPURUN_ZONE unset), `demo` there, `one` in FAR."""
    cli = Cli.under(tmp_path_factory.mktemp("lookup"), emulator)
    cli.env.pop("TPURUN_ZONE")
    work = cli.cwd
    (work / "tpurun.toml").write_text(f'zone = "{emulator.zone}"\n')
    try:
        assert emulator.zone != FAR
        create_node(cli, "demo", "v4-8")
        create_node(cli, "one", "tpu7x-8", "--zone", FAR)
        (work / "tpurun.toml").write_text(f'zone = "{emulator.zone}"\ntpu = "one"\n')  # `one` is the default TPU
        yield cli
    finally:
        emulator.emu.compute_teardown()
        delete_every_tpu(emulator)


def _hostname(r: Result) -> str:
    assert r.code == 0, (r.out, r.err)
    (line,) = r.out.splitlines()
    return line.removeprefix("[w0] ")


def test_a_tpu_is_found_in_the_zone_tpurun_made_it_in(place, emulator):
    cli = place
    assert _hostname(cli("exec", "--tpu", "one", "--", "hostname")) == "one"  # the zone is only tpurun.toml's
    assert _hostname(cli("exec", "--", "hostname")) == "one"  # as the default TPU
    assert json.loads(cli("describe", "one", "--json").out)["zone"] == FAR
    r = cli("ssh", "--tpu", "one", "--", "hostname")
    assert (r.code, r.out.strip()) == (0, "one"), r.err

    # a zone chosen on the command line or in the environment is where the TPU is looked for; the error then
    # names the zone tpurun made it in, and the flag that reaches it
    chosen = [
        ("exec", "--tpu", "one", "--zone", emulator.zone, "--", "true"),
        ("describe", "one", "--zone", emulator.zone),
    ]
    for command in chosen:
        r = cli(*command)
        assert_clean_error(r, 3)
        assert f"no TPU named 'one' in project {emulator.project}, zone {emulator.zone}" in r.err, r.err
        assert f"tpurun made one in zone {FAR}: pass `--zone {FAR}`" in r.err, r.err
    r = tpurun("exec", "--tpu", "one", "--", "true", cwd=cli.cwd, env=cli.env | {"TPURUN_ZONE": emulator.zone})
    assert_clean_error(r, 3)
    assert f"pass `--zone {FAR}`; the zone here comes from env TPURUN_ZONE" in r.err, r.err
    assert _hostname(cli("exec", "--tpu", "one", "--zone", FAR, "--", "hostname")) == "one"

    # list: the zone's TPUs, then a line on those tpurun knows elsewhere (on stderr, JSON or not)
    note = f"tpurun knows TPUs in other zones too: one ({FAR}); `tpurun list --all-zones` lists every zone"
    r = cli("list")
    assert r.code == 0 and "demo" in r.out and "one" not in r.out, r.out
    assert r.err.strip().splitlines()[-1] == note, r.err
    r = cli("list", "--json")
    assert [v["name"] for v in json.loads(r.out)] == ["demo"] and note in r.err, (r.out, r.err)
    r = cli("list", "--all-zones", "--json")
    assert {(v["zone"], v["name"]) for v in json.loads(r.out)} == {(emulator.zone, "demo"), (FAR, "one")}
    assert "other zones" not in r.err, r.err

    # never the wrong TPU: the VM at one's remembered address is another TPU's (demo's worker), which cannot
    # prove it is one's worker: refused, nothing run there, though the zone came from tpurun's record
    demo_ip = json.loads(cli("describe", "demo", "--json").out)["workerEndpoints"][0]["internalIp"]
    one_ip = json.loads(cli("describe", "one", "--json").out)["workerEndpoints"][0]["internalIp"]
    mapped = replace(cli, env=cli.env | {"TPURUN_ADDRESS_MAP": json.dumps({one_ip: demo_ip})})
    r = mapped("exec", "--tpu", "one", "--", "echo", "reached")
    assert r.code == 4 and "HOST KEY CHANGED for worker w0" in r.err and "reached" not in r.out, (r.out, r.err)


def test_the_tpu_name_first(place, emulator):
    cli = place
    demo = _hostname(cli("exec", "--tpu", "demo", "--", "hostname"))
    assert demo != "one"
    # before `--`: the TPU's name (gcloud's order); after it, always the command
    assert _hostname(cli("exec", "demo", "--", "hostname")) == demo
    assert _hostname(cli("exec", "one", "--", "hostname")) == "one"  # in the zone tpurun made it in
    assert _hostname(cli("exec", "-w", "0", "demo", "--", "hostname")) == demo
    assert _hostname(cli("exec", "--", "hostname")) == "one"
    r = cli("exec", "--", "demo", "--", "x")  # `demo` is the command here, run on the default TPU
    assert r.code == 1 and "cannot start demo" in r.err and "127" in r.err, (r.out, r.err)
    r = cli("exec", "--tpu", "demo", "--", "demo", "--", "x")
    assert r.code == 1 and "cannot start demo" in r.err, (r.out, r.err)
    # no `--`: the first word is the TPU when tpurun knows one of that name, else the command
    assert _hostname(cli("exec", "demo", "hostname")) == demo
    assert _hostname(cli("exec", "hostname")) == "one"
    r = cli("ssh", "demo", "--", "hostname")
    assert (r.code, r.out.strip()) == (0, demo), r.err
    r = cli("ssh", "one", "hostname")
    assert (r.code, r.out.strip()) == (0, "one"), r.err
    # gcloud's order with options after the name (it was refused: options are read before the name's word)
    r = cli("ssh", "demo", "--worker", "0", "--", "hostname")
    assert (r.code, r.out.strip()) == (0, demo), r.err
    assert _hostname(cli("exec", "demo", "-w", "0", "--", "hostname")) == demo

    # refused with the right form, exit 2, nothing run
    for command, says in [
        (
            ("exec", "demo", "touch", "m", "--", "touch", "m"),
            "`demo touch m` before --: only the TPU's name goes there",
        ),
        (("exec", "--tpu", "demo", "one", "--", "touch", "m"), "`one` before -- and --tpu demo: name the TPU once"),
        (("exec", "--local", "demo", "--", "touch", "m"), "`demo` before -- names a TPU, and --local this machine"),
        (("exec", "Demo.1", "--", "touch", "m"), "`Demo.1` before --: only the TPU's name goes there"),
        (("ssh", "demo", "one", "--", "touch", "m"), "`demo one` before --"),
    ]:
        r = cli(*command)
        assert_clean_error(r, 2)
        assert says in r.err and "--tpu NAME -- CMD`" in r.err, (command, r.err)
    assert FORM.replace("exec", "ssh") in r.err
    for tpu in ("demo", "one"):
        r = cli("exec", "--tpu", tpu, "--", "ls", "m")
        assert r.code == 1 and "No such file" in r.out + r.err, (r.out, r.err)
    assert not (cli.cwd / "m").exists()

    r = cli("exec", "nosuch", "--", "true")
    assert_clean_error(r, 3)
    assert f"no TPU named 'nosuch' in project {emulator.project}, zone {emulator.zone}" in r.err, r.err

    # `ssh NAME` alone names a TPU the API has, even one tpurun never reached (made with gcloud)
    _create_behind_tpurun(cli, emulator, "gc")
    r = cli("ssh", "gc", input="hostname\n")
    assert r.code == 0 and r.out.strip().splitlines()[-1].startswith("t1v-n-"), (r.out, r.err)
    assert r.out.strip().splitlines()[-1] != demo


def _create_behind_tpurun(cli, emulator, name: str) -> None:
    """gcloud's way, with tpurun's key in its ssh-keys (as its user would put it there)."""
    from google.cloud import tpu_v2

    pub = cli.key.with_suffix(".pub").read_text().strip()
    node = tpu_v2.Node(
        accelerator_type="v4-8",
        runtime_version="tpu-ubuntu2204-base",
        metadata={"ssh-keys": f"root:{pub}"},
        network_config=tpu_v2.NetworkConfig(enable_external_ips=True),  # gcloud's default: reachable from here
    )
    emulator.client().create_node(parent=emulator.parent, node_id=name, node=node).result(polling=fast_polling())
    emulator.wait_startup(emulator.node_name(name))


def test_a_gone_tpu_is_reported_in_one_wording_with_a_hint_that_fits_the_command(place, emulator):
    cli = place
    create_node(cli, "aa", "v4-8")
    (cli.cwd / "job.py").write_text("print('ran')\n")
    r = cli("train", "job.py", "--tpu", "aa", "--runtime", "cpu", "--cores", "1", "--python", "python3", "--json")
    assert r.code == 0, r.err
    job = json.loads(r.out)["job_id"]
    assert cli("delete", "aa", "--yes").code == 0
    gone = re.compile(
        rf"^error: no TPU named 'aa' in project {emulator.project}, zone {emulator.zone}: it was deleted by "
        r"`tpurun delete` \d+s ago \((?P<hint>.*)\)$"
    )
    default = {"TPURUN_TPU": "aa"}
    hints = {}
    for command, extra in [
        (("logs", job), {}),
        (("describe", "aa"), {}),
        (("delete", "aa", "--yes"), {}),
        (("exec", "--tpu", "aa", "--", "true"), {}),
        (("exec", "aa", "--", "true"), {}),
        (("ssh", "aa", "--", "true"), {}),
        (("train", "job.py", "--tpu", "aa"), {}),
        (("exec", "--", "true"), default),
        (("train", "job.py"), default),
        (("ssh", "--", "true"), default),
    ]:
        r = tpurun(*command, cwd=cli.cwd, env=cli.env | extra)
        assert_clean_error(r, 3)
        (line,) = r.err.strip().splitlines()
        m = gone.match(line)
        assert m, (command, line)
        hints[command[0] + (" by default" if extra else "")] = m["hint"]
    job_hint = "the job's record names it; `tpurun jobs --prune` forgets the jobs whose TPU is gone"
    assert hints["logs"] == job_hint
    ended = tpurun("cancel", job, cwd=cli.cwd, env=cli.env)  # its end is on record: no TPU to ask
    assert ended.code == 0 and "had already ended (finished): nothing to stop" in ended.err, ended.err
    for named in ("describe", "delete", "exec", "ssh", "train"):
        assert hints[named] == "`tpurun list` shows the TPUs that exist", (named, hints[named])
    made = "it is the default TPU here (env TPURUN_TPU): `tpurun create aa -t TYPE` makes it again, `tpurun attach NAME` makes another the default"
    assert hints["exec by default"] == hints["train by default"] == made + ", or pass --local"
    assert hints["ssh by default"] == made  # ssh has no --local


def test_a_missing_tpu_is_answered_without_importing_compute_engines_client(place, emulator):
    """Compute Engine is asked by plain REST whether it has anything of the name; its client (a second to
    import) only when it does. Python's own import log tells what the CLI imported."""
    cli = place

    def imported(*args: str) -> tuple[Result, set[str]]:
        env = {k: v for k, v in os.environ.items() if k != "TPURUN_TPU"} | cli.env
        argv = [sys.executable, "-X", "importtime", "-m", "tpurun", *args]
        proc = subprocess.run(argv, cwd=cli.cwd, env=env, capture_output=True, text=True, timeout=120)
        timed = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
        rest = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
        return Result(proc.returncode, proc.stdout, rest), {line.rsplit("|", 1)[-1].strip() for line in timed}

    for command in (
        ("exec", "--tpu", "nosuch", "--", "true"),
        ("describe", "nosuch"),
        ("exec", "nosuch", "--", "true"),
    ):
        r, modules = imported(*command)
        assert r.code == 3 and "no TPU named 'nosuch'" in r.err, r.err[-2000:]
        assert "google.cloud.tpu_v2" in modules  # the Cloud TPU API was asked
        assert "google.cloud.compute_v1" not in modules, command
    # what Compute Engine answers counts as before: a refusal (its API not enabled, no permission) is passed
    # over with a warning, as the Cloud TPU API has answered; a transient failure is retried
    try:
        emulator.fail_api(1, 403, match="GET /compute/v1/")
        r = cli("exec", "--tpu", "nosuch", "--", "true")
        assert_clean_error(r, 3)
        assert "permission denied" in r.err and "(looking for nosuch there too)" in r.err, r.err
        emulator.fail_api(2, 503, match="GET /compute/v1/")
        r = cli("exec", "--tpu", "nosuch", "--", "true")
        assert_clean_error(r, 3)
        assert r.err.count("retrying") == 2 and "no TPU named 'nosuch'" in r.err, r.err
    finally:
        emulator.restore()
    # a zone without any VM lists its TPUs, and a new node's name is checked free in both APIs (and the
    # project's metadata read for its OS Login policy), without the client either
    r, modules = imported("list", "--json")
    assert r.code == 0 and "demo" in {t["name"] for t in json.loads(r.out)}, r.err[-2000:]
    assert "google.cloud.compute_v1" not in modules
    pinned = sorted((cli.tpurun_home / "nodes").glob("*--demo.json"))
    assert pinned and all(f.stat().st_size for f in pinned)
    known = [f.read_bytes() for f in pinned]
    r, modules = imported("create", "demo", "-t", "v4-8")
    assert r.code == 2 and "the Cloud TPU API already has a TPU of that name" in r.err, r.err[-2000:]
    assert "google.cloud.compute_v1" not in modules
    assert [f.read_bytes() for f in pinned] == known  # the TPU that has the name keeps what tpurun knows of it
    r, modules = imported("create", "two", "-t", "v4-8", "--no-wait")
    try:
        assert r.code == 0, r.err[-2000:]
        assert "google.cloud.compute_v1" not in modules
    finally:
        assert cli("delete", "two", "--yes").code == 0
    # a Compute Engine TPU is found and listed through its client: the checks above can tell
    r, modules = imported("describe", "one", "--zone", FAR, "--json")
    assert r.code == 0 and json.loads(r.out)["backend"] == "compute", r.err[-2000:]
    assert "google.cloud.compute_v1" in modules
    r, modules = imported("list", "--zone", FAR, "--json")
    assert r.code == 0 and "one" in {t["name"] for t in json.loads(r.out)}, r.err[-2000:]
    assert "google.cloud.compute_v1" in modules
    r, modules = imported("create", "one", "-t", "v4-8", "--zone", FAR)
    assert r.code == 2 and "one: Compute Engine already has a TPU of that name" in r.err, r.err[-2000:]
