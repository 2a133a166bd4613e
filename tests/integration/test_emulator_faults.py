"""`tpurun emulator`'s faults on Compute Engine TPUs, through the real CLI: maintenance of a managed instance
group's VM read as tpurun reads it (REPAIRING, on the worker tpurun calls wN), `--zone` where a name is in two
zones, kill-sshd and kill-worker on a group and on a lone VM, and the preempt refusal naming its flag. One group
of four VMs and one lone VM of the same name in another zone serve every test (the kills come last)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.helpers import assert_clean_error, by_tag, create_node, delete_every_tpu
from tests.integration.conftest import Cli

pytestmark = pytest.mark.integration

FAR = "us-central1-c"  # where the lone VM `quad` is; the group `quad` is in the emulator's default zone


@pytest.fixture(scope="module")
def place(emulator, tmp_path_factory) -> Iterator[Cli]:
    cli = Cli.under(tmp_path_factory.mktemp("faults"), emulator)
    try:
        assert emulator.zone != FAR
        create_node(cli, "quad", "tpu7x-32")
        create_node(cli, "quad", "tpu7x-8", "--zone", FAR)
        yield cli
    finally:
        emulator.restore()
        emulator.emu.compute_teardown()
        delete_every_tpu(emulator)


def _vm_of(cli: Cli) -> dict[str, str]:
    """{wN: the VM's name} of the group `quad`, as tpurun numbers its workers."""
    r = cli("exec", "--tpu", "quad", "--", "hostname")
    assert r.code == 0, r.err
    return {tag: lines[-1] for tag, lines in by_tag(r.out).items()}


def _worker_out_of_order(emulator, names: dict[str, str]) -> int:
    """A worker whose place in the emulator's order of making differs from tpurun's wN, where there is one (a
    group names its VMs at random): the one the old numbering would have got wrong."""
    (group,) = [m.group for p, m in emulator.emu.migs.items() if p.endswith("/quad")]
    made = [p.rsplit("/", 1)[-1] for p in group.members]
    return next((n for n in range(len(made)) if made[n] != names[f"w{n}"]), 1)


def _status(emulator, vm: str) -> str:
    (st,) = [i["status"] for i in emulator.admin.status()["instances"] if i["name"].endswith(f"/{vm}")]
    return st


def _until(check, timeout: float = 60.0):
    deadline = time.time() + timeout
    while not (got := check()):
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)
    return got


def test_maintenance_of_a_groups_vm_is_repairing_on_the_worker_tpurun_names(place, emulator):
    """`emulator maintenance quad --worker N --zone Z` takes down the VM tpurun calls wN; while it is down the
    emulator says REPAIRING of it (Compute Engine's status for a VM whose host is maintained) and tpurun's
    list and describe say REPAIRING of the TPU, not CREATING; then it is READY again."""
    cli = place
    names = _vm_of(cli)
    n = _worker_out_of_order(emulator, names)
    # down long enough for the two CLIs below to see it, on a loaded machine too
    r = cli("emulator", "maintenance", "quad", "--worker", str(n), "--zone", emulator.zone,
            "--notice", "0", "--duration", "15s")  # fmt: skip
    assert r.code == 0, r.err
    _until(lambda: _status(emulator, names[f"w{n}"]) == "REPAIRING", timeout=10)
    described = json.loads(cli("describe", "quad", "--json").out)
    assert described["state"] == "REPAIRING", described
    assert [m["on"] for m in described["maintenance"]] == [names[f"w{n}"]], described["maintenance"]
    listed = json.loads(cli("list", "--json").out)
    assert [t["state"] for t in listed if t["name"] == "quad" and t["zone"] == emulator.zone] == ["REPAIRING"]
    assert all(_status(emulator, vm) == "RUNNING" for w, vm in names.items() if w != f"w{n}")
    _until(lambda: json.loads(cli("describe", "quad", "--json").out)["state"] == "READY")


def test_a_name_in_two_zones_needs_the_zone(place, emulator):
    """`maintenance quad` is ambiguous (a group here, a VM in FAR): it says so in one line and names --zone's
    want; with `--zone FAR` the lone VM's maintenance is announced, which `describe --zone FAR` shows."""
    cli = place
    r = cli("emulator", "maintenance", "quad", "--notice", "1h")
    assert_clean_error(r, 2)
    assert "give its zone" in r.err and FAR in r.err, r.err
    r = cli("emulator", "maintenance", "quad", "--zone", FAR, "--notice", "1h", "--duration", "1s")
    assert r.code == 0, r.err
    far = json.loads(cli("describe", "quad", "--zone", FAR, "--json").out)
    assert [(m["on"], m["status"]) for m in far["maintenance"]] == [("quad", "PENDING")], far
    assert json.loads(cli("describe", "quad", "--json").out)["maintenance"] == []


def test_preempt_of_an_on_demand_vm_names_the_flag(place):
    r = place("emulator", "preempt", "quad", "--instance")
    assert_clean_error(r, 2)
    assert "pass --force to preempt it anyway" in r.err, r.err


def test_kill_sshd_and_kill_worker_on_compute_engine_tpus(place, emulator):
    """kill-sshd and kill-worker act on the worker tpurun calls wN of a group, and on a lone VM's worker 0:
    tpurun then finds that worker, and only that one, unreachable."""
    cli = place
    names = _vm_of(cli)
    n = _worker_out_of_order(emulator, names)
    assert cli("emulator", "kill-sshd", "quad", str(n), "--zone", emulator.zone).code == 0
    r = cli("exec", "--tpu", "quad", "--", "hostname")
    assert r.code == 4, (r.out, r.err)
    assert set(by_tag(r.out)) == {f"w{i}" for i in range(4)} - {f"w{n}"}, r.out
    assert f"w{n}" in r.err, r.err
    assert cli("emulator", "kill-worker", "quad", str(n), "--zone", emulator.zone).code == 0
    down = [e["detail"] for e in list(emulator.emu.request_log) if e["path"] == "kill-worker"]
    assert down and down[-1].endswith(f"/quad worker {n} ({names[f'w{n}']})"), down

    assert cli("emulator", "kill-sshd", "quad", "0", "--zone", FAR).code == 0
    r = cli("exec", "--tpu", "quad", "--zone", FAR, "--", "true")
    assert r.code == 4, (r.out, r.err)
    assert cli("emulator", "kill-worker", "quad", "0", "--zone", FAR).code == 0
    r = cli("emulator", "kill-worker", "quad", "1", "--zone", FAR)
    assert_clean_error(r, 2)
    assert "its worker is 0" in r.err, r.err
