"""The pure parts of autostop: parsing the idle period, the setting in metadata, and how the watchdog
judges the workers' published states (the watchdog itself runs in tests/integration/test_autostop.py)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from tpurun.cloud import autostop
from tpurun.errors import UsageError
from tpurun.worker import agent_files, watchdog, watchdog_reports, watchdog_silent
from tpurun.worker.protocol import HOST
from tpurun.worker.protocol_calls import JobSpec, ProcessSpec


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("off", 0)])
def test_parse_idle(text, seconds, monkeypatch):
    monkeypatch.delenv("TPURUN_WATCHDOG_TICK", raising=False)
    assert autostop.parse_idle(text) == seconds


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0", "longer than 0"),
        ("0m", "longer than 0"),
        ("30", "give a unit, e.g. 30m"),
        ("5x", "not a duration"),
        ("", "not a duration"),
        ("59s", "the shortest idle period is 1m"),
    ],
)
def test_parse_idle_refuses(text, says, monkeypatch):
    monkeypatch.delenv("TPURUN_WATCHDOG_TICK", raising=False)
    with pytest.raises(UsageError) as e:
        autostop.parse_idle(text)
    assert says in e.value.message


def test_the_test_setting_lowers_the_shortest_period(monkeypatch):
    monkeypatch.setenv("TPURUN_WATCHDOG_TICK", "0.5")
    assert autostop.parse_idle("1s") == 1
    with pytest.raises(UsageError):
        autostop.parse_idle("0s")


def test_stop_only_where_the_tpu_can_be_stopped():
    autostop.check_action("stop")
    autostop.check_action("delete", "a (v4-16) cannot be stopped")
    with pytest.raises(UsageError, match="stop: a .v4-16. cannot be stopped"):
        autostop.check_action("stop", "a (v4-16) cannot be stopped")
    with pytest.raises(UsageError, match="choose delete or stop"):
        autostop.check_action("shrink")


def test_setting_round_trip(monkeypatch):
    monkeypatch.setenv("TPURUN_WATCHDOG_TICK", "7")
    md = autostop.metadata(autostop.stand_in(["a-0", "a-1"]), 1800, "delete")
    value = json.loads(md[autostop.KEY])
    assert value["nodes"] == ["projects/-/locations/-/nodes/a-0", "projects/-/locations/-/nodes/a-1"]
    assert value["tick"] == 7.0 and value["idle"] == 1800
    assert autostop.read(md) == autostop.Setting(1800, "delete", 7.0)
    assert autostop.read(md).label() == "delete after 30m idle"
    assert autostop.read({autostop.KEY: json.dumps({**value, "idle": 0})}).label() == "off"
    assert autostop.read({autostop.KEY: json.dumps({**value, "idle": "x"})}) is None
    assert autostop.read({}) is None and autostop.read({autostop.KEY: "not json"}) is None


def published(states):
    """(worker, what it published) as the watchdogs read them: each state through its JSON."""
    return [(name, watchdog.parse_state(json.dumps(st))) for name, st in states]


def test_summarize_idle_since_the_last_worker_became_idle():
    now = 1000.0
    states = published(
        [("w0", {"t": 999, "idle_since": 900, "jobs": []}), ("w1", {"t": 999.5, "idle_since": 950, "jobs": []})]
    )
    seen = watchdog_reports.summarize(states, now, tick=30)
    assert (seen.running, seen.busy, seen.since) == ([], [], 950)


def test_summarize_busy_and_silent_workers():
    now = 1000.0
    states = published(
        [
            ("w0", {"t": 999, "idle_since": None, "jobs": ["j1"], "holders": 0}),
            ("w1", {"t": 999, "idle_since": None, "jobs": [], "holders": 2}),
            ("w2", {"t": 900, "idle_since": 100, "jobs": []}),  # last report 100 s ago: 3 looks of 30 s missed
            ("w3", None),  # never reported
        ]
    )
    seen = watchdog_reports.summarize(states, now, tick=30)
    assert seen.running == ["w0 runs job j1", "w2 silent for 1m40s", "w3 has not reported"]
    assert seen.busy == ["w1: 2 process(es) hold the TPU"]
    assert seen.silent == ["w2 silent for 1m40s", "w3 has not reported"] and seen.dead == []


def test_a_silent_worker_found_dead_keeps_nothing_busy():
    """The deciding watchdog's verdicts, published with its state: a dead VM's worker no longer runs anything, its
    work ended with its last report; a silent VM that still answers stays busy, said as it is."""
    now = 1000.0
    states = published(
        [
            ("w0", {"t": 999, "idle_since": 700, "jobs": [], "silent": {
                "w1": {"since": 800, "dead": True, "vm": "takes no connection at 10.0.0.3:22 (refused)"}}}),
            ("w1", {"t": 800, "idle_since": None, "jobs": ["j1"]}),
        ]
    )  # fmt: skip
    verdicts = watchdog_reports.verdicts_in(states)
    seen = watchdog_reports.summarize(states, now, tick=30, verdicts=verdicts)
    assert seen.running == [] and seen.since == 800
    assert seen.dead == ["w1 dead: silent for 3m20s; its VM takes no connection at 10.0.0.3:22 (refused)"]
    verdicts["w1"].dead, verdicts["w1"].vm = False, "answers at 10.0.0.3:22 (its watchdog does not report)"
    seen = watchdog_reports.summarize(states, now, tick=30, verdicts=verdicts)
    assert seen.running == ["w1 silent for 3m20s; its VM answers at 10.0.0.3:22 (its watchdog does not report)"]


def test_what_the_api_and_the_address_say_of_a_silent_vm():
    """A node gone or unresponsive is dead by the API's word; a READY node's VM by whether its address takes a
    connection (a real listener, and a port nothing listens on)."""
    node = {"state": "READY", "health": "HEALTHY", "networkEndpoints": [{"ipAddress": "127.0.0.1"}]}
    with socket.socket() as listener, socket.socket() as closed:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        up, down = (lambda a, p=s.getsockname()[1]: watchdog_silent.knock(a, p) for s in (listener, closed))
        assert not watchdog_silent.node_verdict(node, 0, 1.0, up).dead
        v = watchdog_silent.node_verdict(node, 0, 1.0, down)
        assert v.dead and "127.0.0.1:22 (refused)" in v.vm and "READY" in v.vm
    assert watchdog_silent.node_verdict({**node, "state": "PREEMPTED"}, 0, 1.0).dead
    assert watchdog_silent.node_verdict({**node, "health": "TIMEOUT"}, 0, 1.0).dead
    assert not watchdog_silent.node_verdict({**node, "state": "REPAIRING"}, None, 1.0).dead  # maintenance: waits
    assert watchdog_silent.vm_verdict(404, {}, 1.0).dead
    assert watchdog_silent.vm_verdict(200, {"status": "TERMINATED"}, 1.0).dead
    assert not watchdog_silent.vm_verdict(200, {"status": "STAGING"}, 1.0).dead


def test_tpu_env_value_and_duration():
    text = "ACCELERATOR_TYPE: 'v4-16'\nMEGASCALE_SLICE_ID: '1'\nZONE: 'us-central2-b'\n"
    assert watchdog.tpu_env_value(text, "MEGASCALE_SLICE_ID") == "1"
    assert watchdog.tpu_env_value(text, "MISSING") == ""
    assert [watchdog_reports.duration(s) for s in (0, 1, 60, 90, 1815, 3600, 5400, 86400, 90000)] == [
        "0s", "1s", "1m", "1m30s", "30m15s", "1h", "1h30m", "1d", "1d1h"
    ]  # fmt: skip


def test_down_jobs_waits_for_the_settle_time_and_runs_once(tmp_path):
    root = tmp_path / "jobs"
    for name, down in (("a", True), ("b", False), ("c", True), ("d", "yes")):
        (root / name).mkdir(parents=True)
        spec = JobSpec(name, 0, [ProcessSpec(HOST, ["python3", "t.py"])], down=down)  # type: ignore[arg-type]
        (root / name / agent_files.SPEC).write_text(json.dumps(spec.to_dict()))
        (root / name / "state.json").write_text(json.dumps({"status": "finished"}))
    old = time.time() - 10
    for name in "ad":
        os.utime(root / name / "state.json", (old, old))
    assert watchdog.down_jobs([str(root)], [], 5, set()) == [str(root / "a")]  # c ended just now; d's is no true
    assert watchdog.down_jobs([str(root)], ["a"], 5, set()) == []
    assert watchdog.down_jobs([str(root)], [], 0, {str(root / "a")}) == [str(root / "c")]


def test_a_down_job_of_a_newer_agent_is_seen_by_an_older_watchdog(tmp_path):
    """The watchdog runs from the bundle the TPU booted with; a newer tpurun's agent may write spec fields it
    does not know: the job is still one started with --down, and the TPU is still deleted after it."""
    jdir = tmp_path / "jobs" / "new"
    jdir.mkdir(parents=True)
    spec = JobSpec("new", 0, [ProcessSpec(HOST, ["python3", "t.py"])], down=True).to_dict()
    (jdir / agent_files.SPEC).write_text(json.dumps({**spec, "a_field_of_tomorrow": 1}))
    assert watchdog.down_pending([str(tmp_path / "jobs")], ["new"]) == ["new"]
    (jdir / agent_files.SPEC).write_text("not json")
    assert watchdog.down_pending([str(tmp_path / "jobs")], ["new"]) == []


def test_summarize_counts_setup_as_work_and_unreadable_states_as_silent():
    now = 1000.0
    states = published(
        [
            ("w0", {"t": 999, "idle_since": None, "jobs": [], "work": ["setup"], "holders": 0}),
            ("w1", {"t": "soon"}),
            ("w2", [1]),
        ]
    )
    seen = watchdog_reports.summarize(states, now, tick=30)
    assert seen.running == ["w0 runs tpurun setup", "w1 has not reported", "w2 has not reported"] and seen.busy == []


def test_no_worker_to_look_at_is_never_idle():
    seen = watchdog_reports.summarize([], 1000.0, tick=30)
    assert seen.running == ["no worker to look at"] and seen.since == 0


def test_the_token_goes_to_https_or_loopback_only():
    assert watchdog.endpoint_ok("https://tpu.googleapis.com")
    assert watchdog.endpoint_ok("http://127.0.0.1:8080") and watchdog.endpoint_ok("http://localhost:1")
    assert not watchdog.endpoint_ok("http://tpu.googleapis.com") and not watchdog.endpoint_ok("tpu.googleapis.com")
    assert not watchdog.endpoint_ok("http://10.0.0.1:80")


def test_the_setting_makes_a_bare_host_https(monkeypatch):
    class Stub:
        endpoint = "tpu.example.com"

        def node_path(self, n):
            return f"projects/p/locations/z/nodes/{n}"

    from tpurun.cloud.tpu_api import TpuApi

    resources = TpuApi(Stub()).watchdog_resources("a", ["a"], False, None)  # type: ignore[arg-type]
    value = json.loads(autostop.setting(resources, 60))
    assert value["endpoint"] == "https://tpu.example.com"
    assert autostop.read({autostop.KEY: json.dumps(value)}).tick == 30.0
