"""Never the wrong TPU: a TPU deleted behind tpurun's back, whose addresses another TPU now has, is refused
by every command that reaches workers (by --tpu and as the default TPU), with nothing run on the other TPU;
a TPU made anew under the same name is used as itself; a job's logs are never read from another TPU, and
`jobs` shows its job as gone until pruned; a VM
that is not the worker the TPU published is refused even when its key is pinned for another TPU; host keys
are pinned from the API under the TPU's identity, never learned from the host."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_clean_error, create_node, job_pids
from tpurun.emulator.pytest_plugin import fast_polling

pytestmark = pytest.mark.integration

# a process that holds bb's TPU: kill-stale would stop it if it reached bb
_HOLD = (
    "setsid nohup python3 -c \"import time; f = open('/dev/accel0', 'rb'); time.sleep(999)\" tag-bb-holder "
    ">/dev/null 2>&1 </dev/null & sleep 0.5"
)


def _delete_behind_tpurun(emulator, name: str) -> None:
    """What the console, gcloud or the TPU's autostop watchdog does: tpurun is not told."""
    emulator.client().delete_node(name=emulator.node_name(name)).result(polling=fast_polling())


def _create_behind_tpurun(cli, emulator, name: str, accel: str) -> None:
    """gcloud's way, with tpurun's key in its ssh-keys (as its user would put it there)."""
    from google.cloud import tpu_v2

    pub = cli.key.with_suffix(".pub").read_text().strip()
    node = tpu_v2.Node(
        accelerator_type=accel,
        runtime_version="tpu-ubuntu2204-base",
        metadata={"ssh-keys": f"root:{pub}"},
        network_config=tpu_v2.NetworkConfig(enable_external_ips=True),  # gcloud's default: reachable from here
    )
    op = emulator.client().create_node(parent=emulator.parent, node_id=name, node=node)
    op.result(polling=fast_polling())
    emulator.wait_startup(emulator.node_name(name))


def _gone(r, name: str = "aa") -> None:
    assert_clean_error(r, 3)
    assert f"no TPU named '{name}'" in r.err and "deleted" in r.err, r.err


def test_a_deleted_tpu_whose_addresses_another_tpu_has_is_refused_everywhere(cli, emulator):
    a = create_node(cli, "aa", "v4-16")  # the default TPU here (tpurun.toml)
    (cli.cwd / "job.py").write_text("import pathlib\npathlib.Path.home().joinpath('job-marker').touch()\nprint('ran')\n")
    r = cli("train", "job.py", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    job = json.loads(cli("jobs", "--json").out)[0]["job_id"]
    assert cli("exec", "--", "rm", "-rf", "job-marker", "project").code == 0
    _delete_behind_tpurun(emulator, "aa")
    b = create_node(cli, "bb", "v4-16")
    assert [w["internalIp"] for w in b["workerEndpoints"]] == [w["internalIp"] for w in a["workerEndpoints"]]
    assert cli("exec", "--tpu", "bb", "--", "sh", "-c", _HOLD).code == 0  # bb's keys are pinned now too
    assert all(job_pids(emulator, "bb", "tag-bb-holder", [w]) for w in (0, 1))

    commands = [
        ("exec", "--", "touch", "exec-marker"),
        ("sync",),
        ("train", "job.py", "--runtime", "cpu", "--cores", "1", "--python", "python3"),
        ("kill-stale",),
        ("ssh", "--", "touch", "ssh-marker"),
        ("doctor",),
        ("download", "project", "back"),
    ]
    for command in commands:
        by_default = cli(*command)
        _gone(by_default)
        assert "default TPU" in by_default.err, (command, by_default.err)
        by_name = cli(command[0], "--tpu", "aa", *command[1:])
        _gone(by_name)
    _gone(cli("logs", job))
    ended = cli("cancel", job)  # its end is on record: nothing to ask of any TPU
    assert ended.code == 0 and "had already ended (finished): nothing to stop" in ended.err, ended.err
    (row,) = json.loads(cli("jobs", "--json").out)
    # its end as its train wrote it, never rewritten; what cannot be seen now said beside it
    assert (row["job_id"], row["status"], row["end"], row["seen"]) == (job, "finished", "finished", "TPU aa deleted")
    r = cli("jobs", "--prune")
    assert r.code == 0 and job in r.out and "forgot 1 job" in r.err, (r.out, r.err)
    assert json.loads(cli("jobs", "--json").out) == []

    r = cli("exec", "--tpu", "bb", "--", "sh", "-c", "ls -a ~")
    assert r.code == 0, r.err
    seen = {line.split()[-1] for line in r.out.splitlines()}
    assert not seen & {"exec-marker", "ssh-marker", "job-marker", "project"}, seen
    assert not (cli.cwd / "back").exists() or not any((cli.cwd / "back").rglob("*"))  # nothing of bb came back
    assert all(job_pids(emulator, "bb", "tag-bb-holder", [w]) for w in (0, 1))  # kill-stale never reached bb
    assert cli("kill-stale", "--tpu", "bb").code == 0


def test_deleted_by_tpurun_says_how(cli, emulator):
    create_node(cli, "gone", "v4-8")
    assert cli("exec", "--tpu", "gone", "--", "true").code == 0
    assert cli("delete", "gone", "--yes").code == 0
    r = cli("exec", "--tpu", "gone", "--", "true")
    assert_clean_error(r, 3)
    assert "no TPU named 'gone'" in r.err and "deleted by `tpurun delete`" in r.err, r.err


def test_a_tpu_made_anew_under_the_same_name_is_itself_and_old_jobs_stay_with_the_old_one(cli, emulator):
    first = create_node(cli, "again", "v4-16")
    (cli.cwd / "job.py").write_text("print('ran')\n")
    assert cli("train", "job.py", "--runtime", "cpu", "--cores", "1", "--python", "python3").code == 0
    job = json.loads(cli("jobs", "--json").out)[0]["job_id"]
    _delete_behind_tpurun(emulator, "again")
    _create_behind_tpurun(cli, emulator, "again", "v4-16")
    r = cli("exec", "--", "cat", "/etc/hostname")  # remembered id: refused by its keys, then asked the API
    assert r.code == 0, r.err
    second = json.loads(cli("describe", "again", "--json").out)
    assert second["id"] != first["id"]
    assert "tpu." + second["id"] + "-1" in cli.known_hosts.read_text()
    r = cli("logs", job)
    assert_clean_error(r, 3)
    assert f"job {job} ran on the TPU again" in r.err and first["id"] in r.err and second["id"] in r.err, r.err


def test_a_vm_that_is_not_the_worker_is_refused_even_with_a_key_pinned_for_another_tpu(cli, emulator):
    """TPURUN_ADDRESS_MAP sends tpurun's connection for mm's worker 1 to another TPU's worker, whose key
    tpurun pinned (for that TPU): what another VM at the address, or a man in the middle, would present."""
    create_node(cli, "mm", "v4-16")
    other = create_node(cli, "other", "v4-8")
    assert cli("exec", "--tpu", "other", "--", "true").code == 0
    mm = json.loads(cli("describe", "mm", "--json").out)
    victim = mm["workerEndpoints"][1]["internalIp"]
    cli.env["TPURUN_ADDRESS_MAP"] = json.dumps({victim: other["workerEndpoints"][0]["internalIp"]})
    cli.known_hosts.write_text("")  # nothing pinned: the keys come from the API again, never from the host
    r = cli("exec", "--tpu", "mm", "--", "echo", "reached")
    assert r.code == 4, (r.out, r.err)
    assert "HOST KEY CHANGED for worker w1" in r.err and "Traceback" not in r.err
    assert r.out.count("reached") == 1  # worker 0 ran; the VM posing as worker 1 got nothing
    keys = cli.known_hosts.read_text().splitlines()
    assert sorted(line.split()[0] for line in keys) == [f"tpu.{mm['id']}-0", f"tpu.{mm['id']}-1"]
    del cli.env["TPURUN_ADDRESS_MAP"]
    assert cli("exec", "--tpu", "mm", "--", "true").code == 0


def test_through_relays_a_tpu_made_anew_under_the_same_name_is_itself(cli, emulator):
    """The relays' roots are reached through the target's own connect: a root that does not prove who it is
    sends tpurun to the API, and the TPU made anew is used with its own workers (and download, which goes
    from this machine to each worker, reaches them too)."""
    first = create_node(cli, "anew", "v4-16")
    assert cli("exec", "--tpu", "anew", "--relay", "--", "true").code == 0  # remembered
    _delete_behind_tpurun(emulator, "anew")
    _create_behind_tpurun(cli, emulator, "anew", "v4-16")
    r = cli("exec", "--tpu", "anew", "--relay", "--", "sh", "-c", "hostname | tee made")
    assert r.code == 0, r.err
    second = json.loads(cli("describe", "anew", "--json").out)
    assert second["id"] != first["id"]
    assert len([line for line in r.out.splitlines() if line.startswith("[w")]) == 2, r.out
    r = cli("download", "--tpu", "anew", "--relay", "made", "back")
    assert r.code == 0, r.err
    assert sorted(p.parent.name for p in (cli.cwd / "back").glob("*/made")) == ["w0", "w1"]
