"""A job's notices of host events, on each worker (stdlib only, Python >= 3.8; part of the bundle).

Each worker's supervisor watches its own VM's metadata server: `instance/upcoming-maintenance` (maintenance
announced for this host), `instance/maintenance-event` (it is starting) and `instance/preempted` (this VM is being
preempted), each with a GET the metadata server holds until the value changes (`wait_for_change`), for WAIT seconds
at most, less where an announced window's NOTICE_LEAD begins sooner. A TPU slice is interrupted as a whole when one
of its hosts goes, so a notice seen on one worker is for the whole job. The supervisors listen on the job's notice
port at their internal addresses and pass a notice on through worker 0's: a worker tells worker 0, worker 0 tells
every other (each spec carries only whom its worker tells: one address, or the pod's for worker 0, not every address
for every worker). Each notice is signed with the job's key (HMAC-SHA256; the key reaches the supervisors in the
job's spec, readable by the job's user only). Each supervisor then tells its processes as the job asked
(`protocol_calls.ON_SIGNAL`, `ON_FILE`, `ON_STOP`), once; the client, which may be asleep on a laptop, has no part
in it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

if __package__:  # imported by tpurun (its tests) by its package name
    from tpurun.worker import metaserver
    from tpurun.worker.agent_files import signal_job, write_json_atomic
    from tpurun.worker.protocol import NOTICE_LEAD, Notice, NoticeKind
    from tpurun.worker.protocol_calls import ON_FILE, ON_SIGNAL, ON_STOP
else:  # on a worker: the bundle's files side by side
    import metaserver  # type: ignore[no-redef]
    from agent_files import signal_job, write_json_atomic  # type: ignore[no-redef]
    from protocol import NOTICE_LEAD, Notice, NoticeKind  # type: ignore[no-redef]
    from protocol_calls import ON_FILE, ON_SIGNAL, ON_STOP  # type: ignore[no-redef]

WATCHED = ("instance/preempted", "instance/upcoming-maintenance", "instance/maintenance-event")
WAIT = 60  # seconds the metadata server holds a GET for a change, at most
POLL = 1.0  # seconds before a look again where the metadata server did not answer
SEND_TIMEOUT = 5.0  # seconds a peer may take to take a notice
SENDERS = 32  # peers told at once
# A preemption's notice carries no deadline: the metadata server says `instance/preempted` TRUE and nothing of
# when the VM goes. What Google documents instead: a spot or preemptible VM is sent the ACPI soft power-off when
# `preempted` turns TRUE (after the VM's `preemptionNoticeDuration`, a Compute Engine setting tpurun never makes:
# 0 by default) and is powered off at most 30 s later (docs/maintenance.md).
PREEMPTION_NOTICE = 30.0  # seconds a preempted VM may still run once `preempted` says TRUE, at most
MAINTENANCE_NOTICE = 60.0  # seconds `maintenance-event` changes before the host goes
# Once a process of a job ended after a notice (one not to stop), the others are left to end on their own: they
# were all told at once, and a save can take longer on one host than on another. Until the host may go, at most
# this long; then what still runs is stopped, as a failure stops a job (`settle_by`).
SETTLE = 60.0
# A window announced days ahead (scheduled maintenance: about 7) is told to the job only in its last NOTICE_LEAD
# seconds: enough for a step and a checkpoint; `train` says so at its start, `list` and `describe` show it all along.
NOTICE_FILE = "TPURUN_NOTICE_FILE"  # where a job's processes find the notice (`--on-notice file`), in their env


def notice_path(jdir: str) -> str:
    return os.path.join(jdir, "notice.json")


def deliver(notice: Notice, job: str, groups: list, jdir: str) -> str:
    """Tell the job's processes (each of its process GROUPS, and those that left them: each process once) of
    NOTICE as its action says; `stop` is the supervisor's to do. What was done, for its log."""
    action = notice.action
    if action.startswith(ON_SIGNAL):
        sig = signal.Signals[action[len(ON_SIGNAL) :]]
        signal_job(job, groups, sig)
        return f"{sig.name} to every process"
    if action == ON_FILE:
        write_json_atomic(notice_path(jdir), notice.to_dict())
        return f"written to {notice_path(jdir)}"
    return action or "nothing (no --on-notice)"


def settle_by(notice: Notice | None, ended: float) -> float | None:
    """When (epoch seconds) the processes of a job that still run are stopped, once one of them ended at ENDED
    after NOTICE: by the notice's deadline (where it has none, PREEMPTION_NOTICE from when it was seen) and SETTLE
    at most. None where the notice's action stops the job anyway (or there was no notice): stop now."""
    if notice is None or notice.action == ON_STOP:
        return None
    deadline = notice.seen + PREEMPTION_NOTICE if notice.deadline is None else notice.deadline
    return max(ended, min(ended + SETTLE, deadline))


def _when(text: object) -> float | None:
    """An RFC 3339 time of the metadata's as epoch seconds (its fraction of a second dropped: Python before 3.11
    reads only 3 or 6 digits of it); None if there is none or it cannot be read."""
    if not isinstance(text, str) or not text:
        return None
    from datetime import datetime  # a notice's alone: the supervisor of every job imports this module

    try:
        return datetime.fromisoformat(re.sub(r"\.\d+", "", text.strip()).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _wait(path: str, value: str | None) -> int:
    """How long a GET for a change of PATH, whose value is VALUE, may be held: WAIT, less where the maintenance
    VALUE announces is to be told sooner (`look` tells it NOTICE_LEAD seconds before its window)."""
    if path != "instance/upcoming-maintenance" or not value:
        return WAIT
    try:
        start = _when(json.loads(value).get("window_start_time"))
    except (ValueError, AttributeError):
        return WAIT
    return WAIT if start is None else int(max(1, min(WAIT, start - NOTICE_LEAD - time.time() + 1)))


def look(worker: int, action: str, read=metaserver.text) -> Notice | None:
    """What this VM's metadata server announces now (READ: a path's value, None when it has none)."""
    now = time.time()
    if (read("instance/preempted") or "").strip().upper() == "TRUE":
        return Notice(NoticeKind.PREEMPTED, worker, now, None, action, "instance/preempted: TRUE")
    raw = read("instance/upcoming-maintenance")
    try:
        upcoming = json.loads(raw) if raw else None
    except ValueError:
        upcoming = None
    if isinstance(upcoming, dict) and "error" not in upcoming and upcoming.get("maintenance_status"):
        start = _when(upcoming.get("window_start_time"))  # unknown: told only once it is under way
        ongoing = upcoming.get("maintenance_status") == "ONGOING"
        if ongoing or (start is not None and start - now <= NOTICE_LEAD):
            detail = "instance/upcoming-maintenance: " + json.dumps(upcoming, sort_keys=True)
            return Notice(NoticeKind.MAINTENANCE, worker, now, start, action, detail)
    event = (read("instance/maintenance-event") or "").strip()
    if event and event != "NONE":
        detail = f"instance/maintenance-event: {event}"
        return Notice(NoticeKind.MAINTENANCE, worker, now, now + MAINTENANCE_NOTICE, action, detail)
    return None


def sign(key: str, body: bytes) -> str:
    import hashlib  # a notice's alone, as below
    import hmac

    return hmac.new(bytes.fromhex(key), body, hashlib.sha256).hexdigest()


def _signed(key: str, body: bytes, sig: str) -> bool:
    import hmac

    return hmac.compare_digest(sign(key, body), sig)


class NoticeWatch:
    """One worker's watch for its job (the supervisor's, from the job's spec): ON_NOTICE is called once, with the
    first notice seen here or heard from a peer, which is then passed on to the peers this worker tells."""

    def __init__(self, spec, on_notice) -> None:
        self.job, self.worker, self.action = spec.job_id, spec.worker, spec.on_notice
        self.address, self.peers = spec.notice_address, spec.peers
        self.port, self.key = spec.notice_port, spec.notice_key
        self.on_notice = on_notice
        self.got: Notice | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.listener: socket.socket | None = None
        self.telling: threading.Thread | None = None  # passing the notice on; `stop` waits for it

    def start(self, log) -> None:
        """Listen for the peers' notices (where the job has peers) and watch the metadata server, on threads."""
        if self.address and self.port and self.key:
            try:
                self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.listener.bind((self.address, self.port))
                self.listener.listen(64)
            except OSError as e:
                log(f"cannot hear the job's notices on {self.address}:{self.port}: {e}")
                self.listener = None
        if self.listener is not None:
            threading.Thread(target=self._hear, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def stop(self) -> None:
        """No notice is taken after this (the job is over here). A notice being passed on is passed on first, for
        2 × SEND_TIMEOUT at most: its thread is a daemon, and a supervisor whose processes ended at the notice would
        otherwise exit before its peers were told (a loaded worker 1 did, and worker 0 never heard)."""
        with self.lock:
            self.done.set()
            telling = self.telling
        if telling is not None:
            telling.join(2 * SEND_TIMEOUT)
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
            except OSError:
                pass
            self.listener.close()

    def _take(self, notice: Notice) -> bool:
        """NOTICE, the first: passed on to the peers (on a thread of their own: telling 2,047 of them must not
        delay this worker's processes), then told here."""
        with self.lock:
            if self.got is not None or self.done.is_set():
                return False
            self.got = notice
            self.telling = threading.Thread(target=self.tell_peers, args=(notice,), daemon=True)
            self.telling.start()
        self.on_notice(notice)
        return True

    def _watch(self) -> None:
        """Each watched value followed on a thread of its own; what they show looked at after each change."""
        seen: dict = {}
        for path in WATCHED[1:]:
            threading.Thread(target=self._follow, args=(path, seen), daemon=True).start()
        self._follow(WATCHED[0], seen)

    def _follow(self, path: str, seen: dict) -> None:
        """PATH's value, into SEEN, as it changes, until the job is over here or a notice was taken."""
        tag, wait = "", 0
        while not self.done.is_set() and self.got is None:
            value, tag = metaserver.tagged(path, tag, wait)
            if value is not None:
                seen[path] = value
                notice = look(self.worker, self.action, seen.get)
                if notice is not None and self._take(notice):
                    return
            wait = _wait(path, value) if tag else 0
            if not tag:  # no answer, or one without a tag to wait on: looked at again after POLL
                self.done.wait(POLL)

    def tell_peers(self, notice: Notice) -> None:
        """NOTICE to the supervisors this one tells (a peer that does not answer is passed over); a peer that had
        it already drops it."""
        body = json.dumps({"job": self.job, "notice": notice.to_dict()}).encode()
        line = json.dumps({"sig": sign(self.key, body), "body": body.decode()}).encode() + b"\n"

        def send(address: str) -> None:
            try:
                with socket.create_connection((address, self.port), timeout=SEND_TIMEOUT) as s:
                    s.sendall(line)
            except OSError:
                pass

        if self.peers and self.key and self.port:
            from concurrent.futures import ThreadPoolExecutor  # once a notice is told: most jobs never load it

            with ThreadPoolExecutor(max_workers=min(SENDERS, len(self.peers))) as pool:
                list(pool.map(send, self.peers))

    def _hear(self) -> None:
        listener = self.listener
        assert listener is not None
        while not self.done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(SEND_TIMEOUT)
                notice = self._read(conn)
            if notice is not None:
                self._take(notice)

    def _read(self, conn: socket.socket) -> Notice | None:
        """A peer's notice for this job, if it is signed with the job's key; None otherwise."""
        data = b""
        try:
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            msg = json.loads(data)
            body = str(msg["body"]).encode()
            if not _signed(self.key, body, str(msg["sig"])):
                return None
            inner = json.loads(body)
            return Notice.from_dict(inner["notice"]) if inner.get("job") == self.job else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
