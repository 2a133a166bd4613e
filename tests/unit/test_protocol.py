"""The agent's protocol round-trips: every record kind tpurun reads, encoded where the agent encodes it (the
bundle's own flat copy of protocol.py, in a separate interpreter, the oldest Python the bundle supports
where this machine has it), decoded by tpurun, and the other way round."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import PY38
from tpurun.worker import WORKER_DIR, protocol, protocol_calls, watchdog_reports

SLOT = protocol.SlotState(
    0, protocol.ProcessStatus.FAILED, 3, 4243, 4243, 1764000000.5, 1764000002.0, "Traceback \u00e9", 1764000001.75,
    [protocol.Passage("init_process_group", 1764000000.75, 1764000001.0)], ["python3", "train.py"], True,
)  # fmt: skip
# a job's state with every field set, and one as the agent's `start` first writes it
STATE = protocol.JobState(
    "20261125-000000-abcd", 2, protocol.JobStatus.FAILED, 4242, 1764000000.0, 1764000003.0, False, True,
    protocol.Launch.host, "", protocol.FirstFailure(0, 3, 1764000002.0, 2),
    [SLOT, protocol.SlotState(protocol.HOST, protocol.ProcessStatus.KILLED, -15)], False, protocol.JobStatus.RUNNING,
    protocol.Notice(protocol.NoticeKind.MAINTENANCE, 1, 1764000001.5, 1764000061.0, "signal:SIGTERM", "é {}"),
)  # fmt: skip
STARTING = protocol.JobState("20261125-000000-abcd", 0, protocol.JobStatus.STARTING, started_at=1764000000.0)

# the watchdog's configuration: a Cloud TPU API TPU's (autostop off, and set), a Compute Engine VM's and groups'
TPU_NODES = watchdog_reports.WatchdogConfig("https://tpu.googleapis.com", ["projects/p/locations/z/nodes/t"])
WATCHDOG = [
    TPU_NODES,
    TPU_NODES.set(1800, "stop", 7.5),
    watchdog_reports.WatchdogConfig("http://127.0.0.1:1", compute=watchdog_reports.ComputeTpu("p", "z", "t", "t")),
    watchdog_reports.WatchdogConfig(
        "https://compute.googleapis.com",
        compute=watchdog_reports.ComputeTpu(
            "p", "z", "t", "", ["t-0", "t-1"], ["projects/p/global/instanceTemplates/t"]
        ),
        idle=600,
    ),
    watchdog_reports.WatchdogConfig(  # `create --budget`: its spend limit
        "https://tpu.googleapis.com", ["projects/p/locations/z/nodes/t"], spend_usd=0.5, spend_until=1764003600.5
    ),
]

RECORDS: list[protocol.Record] = [
    protocol.Line(3, 5, 120, protocol.Source.OUT, 1764000000.25, 'step 1 "loss" 0.5 \u00e9 \\ tab\there'),
    protocol.Line(0, protocol.HOST, 7, protocol.Source.ERR, 1764000001.0, ""),
    protocol.Exit(1, 2, 3, protocol.ProcessStatus.FAILED),
    protocol.Exit(1, 0, None, protocol.ProcessStatus.DIED),
    protocol.Exit(0, protocol.HOST, -9, protocol.ProcessStatus.KILLED),
    protocol.Done(2, STATE),
    protocol.Done(0, STARTING),
    protocol.Started("20261125-000000-abcd", 1, 4242, [protocol.SlotState(0, protocol.ProcessStatus.RUNNING)]),
    protocol.StartFailed("20261125-000000-abcd", "pre-command ['x'] exited 1 (see pre.log)"),
    protocol.Passages(
        3,
        protocol.HOST,
        [protocol.Passage("jax.distributed.initialize", 1764000000.5, 1764000003.25), protocol.Passage("x", 1.0)],
    ),
    protocol.Passages(0, 2, []),
    protocol.Notice(protocol.NoticeKind.PREEMPTED, 3, 1764000002.0, None, "file"),
]

# The agent's side: the bundle's protocol.py imported the way the agent imports it (its directory first on
# sys.path, not as part of tpurun); each line of stdin decoded and encoded again.
AGENT_SIDE = """
import sys
sys.path.insert(0, sys.argv[1])
import json
import protocol
import protocol_calls
import watchdog_reports
for raw in sys.stdin.buffer:
    kind, _, body = raw.partition(b" ")
    if kind == b"record":
        rec = protocol.decode(body)
        assert rec is not None, body
        sys.stdout.buffer.write(protocol.encode(rec))
    elif kind == b"spec":
        sys.stdout.buffer.write(protocol_calls.JobSpec.from_json(body.decode()).to_json().encode() + b"\\n")
    elif kind == b"state":
        sys.stdout.buffer.write(protocol.JobState.from_json(body).to_json().encode() + b"\\n")
    elif kind == b"jobs":
        sys.stdout.buffer.write(json.dumps([s.to_dict() for s in protocol.job_states(body)]).encode() + b"\\n")
    elif kind == b"watchdog":
        sys.stdout.buffer.write(watchdog_reports.WatchdogConfig.from_json(body.decode()).to_json().encode() + b"\\n")
    elif kind == b"preflight":
        sys.stdout.buffer.write(protocol_calls.Preflight.from_json(body.decode()).to_json().encode() + b"\\n")
    elif kind == b"watch":
        sys.stdout.buffer.write(watchdog_reports.WatchState.from_json(body).to_json().encode() + b"\\n")
    elif kind == b"stop":
        stop = protocol_calls.StopRequest.from_dict(json.loads(body))
        sys.stdout.buffer.write(json.dumps(stop.to_dict()).encode() + b"\\n")
    elif kind == b"hook":
        slot, stream, pool = protocol.read_hook_header(body)
        sys.stdout.buffer.write(protocol.hook_header(slot, stream, pool))
    elif kind == b"end":
        end, code = protocol.read_task_end(body)
        sys.stdout.buffer.write(protocol.task_end(end, code))
    elif kind == b"passage":
        sys.stdout.buffer.write(protocol.passage_line(protocol.Passage.from_dict(json.loads(body))))
"""

SPEC = protocol_calls.JobSpec(
    job_id="20261125-000000-abcd",
    worker=2,
    cores=[protocol_calls.ProcessSpec(protocol.HOST, ["python3", "train.py", "--lr", "1e-3"], {"A": "b c"}, "~/proj")],
    launch=protocol.Launch.host,
    detach=True,
    grace=2.5,
    pre_commands=[["true"], {"argv": ["sleep", "9"], "wait": False}],
    lease_timeout=0,
    spend_for=5.625,
)


@pytest.mark.parametrize("python", [sys.executable, PY38], ids=["this-python", "python3.8"])
def test_every_record_kind_round_trips_through_the_agent_side(python: str | None) -> None:
    if python is None:
        pytest.skip("no python3.8 here")
    lines = [b"record " + protocol.encode(r) for r in RECORDS]
    lines.append(b"spec " + SPEC.to_json().encode() + b"\n")
    lines += [b"hook " + protocol.hook_header(7, s, True) for s in protocol.HookStream]
    lines += [b"end " + protocol.task_end(e, c) for e, c in [(protocol.TaskEnd.OK, 0), (protocol.TaskEnd.FAILED, 3)]]
    lines.append(b"hook " + protocol.hook_header(protocol.HOST, protocol.HookStream.WAIT, False))
    passages = [protocol.Passage("xm.rendezvous('init')", 5.5), protocol.Passage("torch", 1764000000.0, 1764000009.5)]
    lines += [b"passage " + protocol.passage_line(p) for p in passages]
    r = subprocess.run(
        [python, "-c", AGENT_SIDE, str(WORKER_DIR)], input=b"".join(lines), capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr.decode()
    back = r.stdout.splitlines(keepends=True)
    assert len(back) == len(lines)
    assert [protocol.decode(b) for b in back[: len(RECORDS)]] == RECORDS
    assert protocol_calls.JobSpec.from_json(back[len(RECORDS)].decode()) == SPEC
    # each process's slot goes on the wire as "core", on the way there and back
    sent, echoed = json.loads(SPEC.to_json()), json.loads(back[len(RECORDS)])
    assert [p["core"] for p in sent["cores"]] == [p["core"] for p in echoed["cores"]] == [protocol.HOST]
    assert sent == echoed and all(sorted(p) == ["argv", "core", "cwd", "env"] for p in sent["cores"])
    n = len(protocol.HookStream)
    hooks = back[len(RECORDS) + 1 : len(RECORDS) + 1 + n]
    assert [protocol.read_hook_header(h) for h in hooks] == [(7, s, True) for s in protocol.HookStream]
    ends = back[len(RECORDS) + 1 + n : len(RECORDS) + 3 + n]
    assert [protocol.read_task_end(e) for e in ends] == [(protocol.TaskEnd.OK, 0), (protocol.TaskEnd.FAILED, 3)]
    # a process tpurun started (slot HOST) reports its passages on a wait connection, and only there
    waits = back[len(RECORDS) + 3 + n :]
    assert protocol.read_hook_header(waits[0]) == (protocol.HOST, protocol.HookStream.WAIT, False)
    with pytest.raises(ValueError):
        protocol.read_hook_header(protocol.hook_header(protocol.HOST, protocol.HookStream.OUT, False))
    assert [protocol.Passage.from_dict(json.loads(w)) for w in waits[1:]] == passages


@pytest.mark.parametrize("python", [sys.executable, PY38], ids=["this-python", "python3.8"])
def test_the_job_state_and_the_answers_carrying_it_round_trip_through_the_agent_side(python: str | None) -> None:
    if python is None:
        pytest.skip("no python3.8 here")
    pre = protocol_calls.Preflight([STATE, STARTING], "3.8.18", "/usr/bin/python3", {"jax": "0.4.30", "x": None}, "j")
    jobs = json.dumps([STATE.to_dict(), STARTING.to_dict()]).encode()
    lines = [b"state " + STATE.to_json().encode(), b"state " + STARTING.to_json().encode(), b"jobs " + jobs]
    lines.append(b"preflight " + pre.to_json().encode())
    lines += [b"watchdog " + c.to_json().encode() for c in WATCHDOG]
    r = subprocess.run(
        [python, "-c", AGENT_SIDE, str(WORKER_DIR)], input=b"\n".join(lines) + b"\n", capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr.decode()
    back = r.stdout.splitlines()
    assert [protocol.JobState.from_json(b) for b in back[:2]] == [STATE, STARTING]
    assert protocol.job_states(back[2]) == [STATE, STARTING]
    assert protocol_calls.Preflight.from_json(back[3].decode()) == pre
    assert [watchdog_reports.WatchdogConfig.from_json(b.decode()) for b in back[4:]] == WATCHDOG
    # the Cloud TPU API's resources are its nodes; a Compute Engine TPU's, its VM or its groups and what goes with them
    assert [sorted(json.loads(b)) for b in back[4:6]] == [["action", "endpoint", "idle", "nodes", "silent", "tick"]] * 2
    assert json.loads(back[6])["compute"] == {"project": "p", "zone": "z", "name": "t", "instance": "t"}
    # state.json's keys as docs/train.md names them: each process under "cores", its slot under "core"
    wire = json.loads(back[0])
    assert sorted(wire) == sorted(
        ["job_id", "worker", "status", "supervisor_pid", "started_at", "ended_at", "stopping", "detach", "launch"]
        + ["reason", "first_failure", "cores", "supervisor_alive", "status_before_stop", "notice"]
    )
    assert [c["core"] for c in wire["cores"]] == [0, protocol.HOST] and wire["first_failure"]["core"] == 0
    # what the agent's readers add is absent where they did not add it (state.json itself)
    assert "supervisor_alive" not in json.loads(back[1]) and "status_before_stop" not in json.loads(back[1])


# what each worker's watchdog publishes: busy with a `--down` job, idle, and as an older watchdog left it out
WATCH = [
    watchdog_reports.WatchState(1764000000.5, 3, ["j1", "j2"], ["setup"], 2, None, ["j2"]),
    watchdog_reports.WatchState(1764000000.0, 0, idle_since=1763990000.5),
    # the deciding watchdog's, with its verdict on a silent worker
    watchdog_reports.WatchState(
        1764000000.0, 0, idle_since=1763990000.5, silent={"w5": watchdog_reports.Silent(1763999700.0, True, "is gone")}
    ),
]


@pytest.mark.parametrize("python", [sys.executable, PY38], ids=["this-python", "python3.8"])
def test_the_watchdogs_state_and_a_stop_request_round_trip_through_the_agent_side(python: str | None) -> None:
    if python is None:
        pytest.skip("no python3.8 here")
    stop = protocol_calls.StopRequest(2.5, 1764000000.25)
    lines = [b"watch " + w.to_json().encode() for w in WATCH] + [b"stop " + json.dumps(stop.to_dict()).encode()]
    r = subprocess.run(
        [python, "-c", AGENT_SIDE, str(WORKER_DIR)], input=b"\n".join(lines) + b"\n", capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr.decode()
    back = r.stdout.splitlines()
    assert [watchdog_reports.WatchState.from_json(b) for b in back[:3]] == WATCH
    assert protocol_calls.StopRequest.from_dict(json.loads(back[3])) == stop
    # guest attribute tpurun/watch's keys, sorted as the watchdog publishes them
    assert list(json.loads(back[0])) == ["down", "holders", "idle_since", "jobs", "silent", "t", "work", "worker"]
    assert back[0].decode() == WATCH[0].to_json() and json.loads(back[3]) == {"grace": 2.5, "at": 1764000000.25}
    assert json.loads(back[2])["silent"] == {"w5": {"since": 1763999700.0, "dead": True, "vm": "is gone"}}


def test_a_watchdogs_state_an_older_watchdog_wrote_reads_and_a_broken_one_says_so() -> None:
    older = watchdog_reports.WatchState.from_json('{"t": 5, "jobs": ["j"]}')
    assert older == watchdog_reports.WatchState(5.0, jobs=["j"])
    for broken in ["", "[1]", "{}", '{"t": "soon"}', '{"t": 1, "holders": "many"}', '{"t": 1, "jobs": 3}']:
        with pytest.raises(ValueError):
            watchdog_reports.WatchState.from_json(broken)
    for broken_stop in [{}, {"grace": "long", "at": 1}, [1], None]:
        with pytest.raises(ValueError):
            protocol_calls.StopRequest.from_dict(broken_stop)


def test_a_job_state_an_older_agent_wrote_reads_and_a_broken_one_says_so() -> None:
    old = {"job_id": "j", "worker": 1, "status": "failed", "first_failure": {"core": 2, "exit_code": 3}, "new": 1}
    st = protocol.JobState.from_dict(old)
    assert (st.status, st.launch, st.slots, st.first_failure) == (
        protocol.JobStatus.FAILED,
        protocol.Launch.chip,
        [],
        protocol.FirstFailure(2, 3),
    )
    for broken in [{}, {"status": "sideways"}, {"status": "running", "cores": [{"status": "running"}]}, [1]]:
        with pytest.raises(ValueError):
            protocol.JobState.from_dict(broken)
    with pytest.raises(ValueError):
        protocol.job_states(b'{"status": "running"}')


def test_rec_lines_framed_by_the_agent_are_the_lines_they_were() -> None:
    texts = ["x\ny", "", 'quote " and \u00e9', "\x00"]
    recs = protocol.encode_recs(protocol.Source.ERR, 12.5, texts).split(b"\n")[:-1]
    assert recs[0] + b"\n" == protocol.encode_rec(protocol.Source.ERR, 12.5, texts[0])
    framed, end = protocol.frame_recs(4, 1, 100, recs)
    assert end == 100 + sum(len(r) + 1 for r in recs)
    assert [t for t, _ in framed] == [12.5] * len(texts)
    offsets = [100 + sum(len(r) + 1 for r in recs[: i + 1]) for i in range(len(recs))]
    lines = [protocol.Line(4, 1, o, protocol.Source.ERR, 12.5, t) for o, t in zip(offsets, texts, strict=True)]
    assert [protocol.decode(f) for _, f in framed] == lines
    assert [protocol.encode(line) for line in lines] == [f for _, f in framed]
    # the client's batch reader: the same records, events among them, what is not a record skipped
    raws = [f.rstrip(b"\n") for _, f in framed] + [b"", b"not json", b"[1]", b'{"w": 1}']
    raws += [protocol.encode(r).rstrip(b"\n") for r in RECORDS]
    assert list(protocol.decode_lines(raws)) == lines + RECORDS
    every_one_json = [r for r in raws if r not in (b"", b"not json")]  # parsed as one array: the same records
    assert list(protocol.decode_lines(every_one_json)) == lines + RECORDS
    for at_once in (1, 2, 3):  # and a part at a time, a part with what is not a record among them too
        assert list(protocol.decode_lines(raws, at_once)) == lines + RECORDS
        assert list(protocol.decode_lines(every_one_json, at_once)) == lines + RECORDS


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1, 2]", b'{"event": "exit", "w": 0}', b'{"w": 0, "c": 1}', b'{"event": "what"}'],
)
def test_what_is_not_a_record_decodes_to_none(raw: bytes) -> None:
    assert protocol.decode(raw) is None


@pytest.mark.parametrize(
    "data, why",
    [
        ({"worker": 0, "cores": [{"core": 0, "argv": ["x"]}]}, "job_id"),
        ({"job_id": "j", "worker": 0, "cores": []}, "cores"),
        ({"job_id": "j", "worker": 0, "cores": [{"core": 0, "argv": ["x"]}], "colour": "blue"}, "unknown fields"),
        ({"job_id": "j", "worker": 0, "cores": [{"core": 0}]}, "malformed"),
        ({"job_id": "j", "worker": 0, "cores": [{"core": 0, "argv": ["x"], "colour": "blue"}]}, "malformed"),
        ({"job_id": "j", "worker": 0, "cores": [{"slot": 0, "argv": ["x"]}]}, "malformed"),
        ({"job_id": "j", "worker": 0, "cores": [[0, ["x"]]]}, "malformed"),
        ({"job_id": "j", "worker": 0, "cores": [{"core": 0, "argv": ["x"]}], "launch": "sideways"}, "sideways"),
    ],
)
def test_a_bad_job_spec_says_what_is_wrong(data: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        protocol_calls.JobSpec.from_json(json.dumps(data))


def test_every_word_prints_as_it_goes_on_the_wire() -> None:
    words = [w for kind in protocol.Word.__subclasses__() for w in kind]
    assert len(words) > 20
    for w in words:
        assert f"{w}" == str(w) == w.value == json.loads(json.dumps(w))
