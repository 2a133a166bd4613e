"""The probe's answers round-trip: every record kind of tpurun.worker.probe built here, printed as the worker
prints it and read back as tpurun reads it, in this interpreter and through the probe's own source run alone
in another one (Python 3.8 where this machine has it), as it runs on a worker; and the real probe's answers,
made by that interpreter, read by tpurun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PY38, python_up
from tpurun import diagnose
from tpurun.worker import probe

HOLDER = probe.Holder(pid=42, uid=0, user="root", age=12.5, command="python3 -c 'x é'", holds=["/dev/accel0"])
SURVIVOR = probe.Holder(pid=43, uid=None, user="?", age=0.0, command="", holds=["/lib/libtpu.so"], result="survived")

KILL_STALE = probe.KillStaleAnswer(
    root=False,
    sudo=True,
    errors=["no permission to signal pid 43 (run as root or allow passwordless sudo)"],
    holders=[HOLDER, SURVIVOR],
    locks=[probe.LockFile(path="/tmp/libtpu_lockfile", result="kept: the TPU is still held")],
    denied=2,
    free=False,
    survivors=[43],
)
HOLDER.result = "terminated (SIGTERM)"

DOCTOR = probe.DoctorAnswer(
    clock=1764000000.25,
    hostname="t1v-n-0",
    user="root",
    root=True,
    python_probe=probe.PythonProbe(python="/usr/bin/python3", python_version="3.10.12", packages={"jax": None}),
    runtime_place=probe.RuntimePlace(given={"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_ID": "0"}, tpu_env=None),
    devices_present=["/dev/accel0", "/dev/accel1"],
    devices_missing=["/dev/accel2"],
    devices_plain=["/dev/accel0"],
    holders=[probe.Holder(pid=7, uid=1000, user="u", age=3.0, command="python3 t.py", holds=["/dev/accel1"])],
    scan_note="could not inspect 3 processes of other users: sudo -n refused",
    locks=[probe.LockFile(path="/tmp/libtpu_lockfile", open_in=[]), probe.LockFile(path="/x", open_in=[7])],
    env={"PJRT_DEVICE": "TPU"},
    env_files=[probe.EnvExport(file="~/.bashrc", line=12, name="XRT_TPU_CONFIG", value="localservice;0;x:1")],
    disk={"home": probe.DiskSpace("/root", 50 << 30), "tmp": probe.DiskSpace("/tmp", None)},
    elapsed=0.5,
)

SCAN = probe.Scan(holders=[probe.Holder(pid=9, start=1234, holds=["/dev/vfio/0"])], denied=[5], lock_users={"/x": [9]})

# the user's Python could not run: its answer is only why
NO_PYTHON = probe.DoctorAnswer(clock=1.0, hostname="h", user="u", python_probe=probe.PythonProbe(error="py: not found"))

RECORDS: list[tuple[str, probe.Record]] = [
    ("kill-stale", KILL_STALE),
    ("doctor", DOCTOR),
    ("doctor", NO_PYTHON),
    ("scan", SCAN),
]
READERS = {"kill-stale": probe.KillStaleAnswer, "doctor": probe.DoctorAnswer, "scan": probe.Scan}

# The worker's side: the probe's source alone (as `program_argv` ships it), reading each line's answer with
# its record's from_dict and printing its to_dict again.
ECHO = """
for line in sys.stdin:
    mode, body = line.split(" ", 1)
    record = {"kill-stale": KillStaleAnswer, "doctor": DoctorAnswer, "scan": Scan}[mode]
    sys.stdout.write(json.dumps(record.from_dict(json.loads(body)).to_dict()) + "\\n")
"""


def test_every_record_reads_back_what_it_printed() -> None:
    for mode, record in RECORDS:
        sent = json.loads(json.dumps(record.to_dict()))
        back = READERS[mode].from_dict(sent)
        assert type(back) is type(record) and back.to_dict() == sent == record.to_dict()
    # what the JSON leaves out while unset: a holder's start (the worker's own) and result (kill-stale's)
    assert SCAN.to_dict()["holders"][0]["start"] == 1234 and "result" not in SCAN.to_dict()["holders"][0]
    assert list(DOCTOR.holders[0].to_dict()) == ["pid", "uid", "user", "age", "command", "holds", "protected"]
    assert DOCTOR.to_dict()["disk"] == {"home": ["/root", 50 << 30], "tmp": ["/tmp", None]}
    assert DOCTOR.to_dict()["locks"] == [
        {"path": "/tmp/libtpu_lockfile", "open_in": []},
        {"path": "/x", "open_in": [7]},
    ]
    assert NO_PYTHON.to_dict()["python_probe"] == {"error": "py: not found"}
    assert probe.DoctorAnswer.from_dict(NO_PYTHON.to_dict()).python_probe.error == "py: not found"
    # what the Python saw, every field the probe script prints, in its order (doctor --json shows it so)
    assert list(DOCTOR.to_dict()["python_probe"]) == [f for f in probe.PythonProbe.__slots__ if f != "error"]
    read = probe.DoctorAnswer.from_dict(DOCTOR.to_dict())
    assert read.disk["tmp"] == probe.DiskSpace("/tmp", None) and read.env_files[0].line == 12
    assert read.runtime_place.given["TPU_WORKER_ID"] == "0" and read.holders[0].pid == 7


@pytest.mark.parametrize("python", [sys.executable, PY38], ids=["this-python", "python3.8"])
def test_every_record_round_trips_through_the_probe_alone(python: str | None) -> None:
    if python is None:
        pytest.skip("no python3.8 here")
    lines = "".join(f"{mode} {json.dumps(record.to_dict())}\n" for mode, record in RECORDS)
    source = Path(probe.__file__).read_text() + ECHO
    r = subprocess.run([python, "-c", source], input=lines, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    back = [json.loads(line) for line in r.stdout.splitlines()]
    assert back == [record.to_dict() for _, record in RECORDS]


@pytest.mark.parametrize("python", [sys.executable, PY38], ids=["this-python", "python3.8"])
def test_the_probes_own_answers_read_as_records(tmp_path: Path, python: str | None) -> None:
    """The probe run as on a worker (`program_argv`) builds its answers through the records; tpurun reads them."""
    if python is None:
        pytest.skip("no python3.8 here")
    dev = tmp_path / "accel0"
    dev.write_bytes(b"")
    (tmp_path / "lockfile").write_text("")
    cfg = {"device_globs": [str(dev)], "libtpu_glob": "no-such-libtpu*.so", "lock_globs": [str(tmp_path / "lockfile")]}
    holder = python_up("import sys, time; f = open(sys.argv[1]); print('up', flush=True); time.sleep(60)", str(dev))
    try:
        argv = probe.program_argv(python, "kill-stale", dict(cfg, dry_run=True))
        data = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout)
        answer = probe.KillStaleAnswer.from_dict(data)
        assert answer.to_dict() == data and not answer.free
        assert [(h.pid, h.holds, h.result) for h in answer.holders] == [(holder.pid, [str(dev)], "would kill")]
        assert [(lk.path, lk.result) for lk in answer.locks] == [(str(tmp_path / "lockfile"), "would remove")]
        # the worker's place comes on stdin (the command line the same on every worker), as diagnose sends it
        argv = probe.program_argv(
            python, "doctor", dict(cfg, probe='print(\'{"python_version": "3"}\')', vm_env_on_stdin=True)
        )
        place = json.dumps({"TPU_WORKER_ID": "3"})
        data = json.loads(subprocess.run(argv, input=place, capture_output=True, text=True, timeout=60).stdout)
        doctor = probe.DoctorAnswer.from_dict(data)
        assert doctor.to_dict() == data and doctor.python_probe.python_version == "3"
        assert doctor.runtime_place.given == {"TPU_WORKER_ID": "3"}
        assert doctor.devices_present == [str(dev)] == doctor.devices_plain and doctor.holders[0].pid == holder.pid
        assert doctor.holders[0].start is None and doctor.disk["tmp"].path == "/tmp"
    finally:
        holder.kill()
        holder.wait()


def test_an_answer_that_is_not_a_record_is_that_workers_error() -> None:
    for bad in ([], {"holders": [{"pid": 1, "colour": "red"}]}, {"free": True, "surprise": 1}):
        with pytest.raises(ValueError):
            probe.KillStaleAnswer.from_dict(bad)
    run = diagnose.ProbeRun(results={0: KILL_STALE.to_dict(), 1: {"holders": "x", "nonsense": 1}})
    answers = diagnose.read_answers(run, probe.KillStaleAnswer.from_dict)
    assert list(answers) == [0] and answers[0].to_dict() == KILL_STALE.to_dict()
    assert run.errors[1].startswith("the probe's answer cannot be read: not a KillStaleAnswer")
