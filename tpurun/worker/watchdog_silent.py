"""Workers whose watchdog went silent, and every worker's reports summed up (stdlib only, Python >= 3.8; part of
the bundle, beside watchdog.py).

A worker that has not published its state for SILENT_TICKS ticks may run work its watchdog cannot tell of: it
counts as busy. Past the configuration's bound (`WatchdogConfig.silent`, TPURUN_WATCHDOG_SILENT) the deciding
worker's watchdog asks what became of its VM: the API first (a Cloud TPU node gone, PREEMPTED, TERMINATED or
STOPPED, or unresponsive (health TIMEOUT); a Compute Engine VM gone or not running), and, where the API says the
VM is up (a Cloud TPU node is READY as a whole: the API has no word of one VM of it), whether its address still
takes a connection on the SSH port from inside the slice. A VM found dead no longer keeps the TPU busy: its work
ended at the latest with its last report, and autostop counts the idle period from then (docs/cost-safety.md).
"""

from __future__ import annotations

import socket
import time

if __package__:
    from tpurun.worker.agent_files import duration
    from tpurun.worker.protocol_calls import Silent, WatchState
else:
    from agent_files import duration  # type: ignore[no-redef]
    from protocol_calls import Silent, WatchState  # type: ignore[no-redef]

SILENT_TICKS = 3  # ticks without a report before a worker is silent
SSH_PORT = 22  # where a TPU VM takes connections (its sshd)
KNOCK_TIMEOUT = 3.0  # seconds a VM has to take the connection
NODE_GONE = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING")  # a Cloud TPU node's, its VMs with it
UNRESPONSIVE = ("TIMEOUT",)  # a Cloud TPU node's health: "the resource is unresponsive"
VM_GONE = ("TERMINATED", "STOPPED", "STOPPING", "SUSPENDED", "SUSPENDING")  # a Compute Engine VM's status


def knock(address: str, port: int = SSH_PORT) -> str:
    """'' if ADDRESS takes a TCP connection on PORT; else what happened ("no answer", "refused", ...)."""
    try:
        with socket.create_connection((address, port), timeout=KNOCK_TIMEOUT):
            return ""
    except socket.timeout:  # noqa: UP041 - not yet TimeoutError on the Python 3.8 and 3.9 of older TPU images
        return "no answer"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return e.strerror or type(e).__name__


def _at(address: str, since: float, what_api: str, knocker) -> Silent:
    why = knocker(address)
    if why:
        return Silent(since, True, f"takes no connection at {address}:{SSH_PORT} ({why}), though {what_api}")
    return Silent(since, False, f"answers at {address}:{SSH_PORT} (its watchdog does not report)")


def node_verdict(node: dict, worker: int | None, since: float, knocker=knock) -> Silent:
    """What became of WORKER's VM of the Cloud TPU NODE (the API's answer; None: the node as a whole)."""
    state, health = str(node.get("state") or "?"), str(node.get("health") or "")
    if state in NODE_GONE:
        return Silent(since, True, f"is gone: the API says its node is {state}")
    if health in UNRESPONSIVE:
        return Silent(since, True, f"is unresponsive: the API says its node's health is {health}")
    if state != "READY" or worker is None:
        return Silent(since, False, f"waits: the API says its node is {state}")
    endpoints = node.get("networkEndpoints") or []
    address = str((endpoints[worker] if worker < len(endpoints) else {}).get("ipAddress") or "")
    if not address:
        return Silent(since, False, "has no address in the API")
    return _at(address, since, "the API says its node is READY", knocker)


def vm_verdict(status: int, vm: dict, since: float, knocker=knock) -> Silent:
    """What became of a Compute Engine VM (the API's answer to its GET: STATUS and VM)."""
    if status == 404:
        return Silent(since, True, "is gone: the API has no such VM")
    state = str(vm.get("status") or "?")
    if status != 200:
        return Silent(since, False, f"could not be asked about (HTTP {status})")
    if state in VM_GONE:
        return Silent(since, True, f"is gone: the API says it is {state}")
    if state != "RUNNING":
        return Silent(since, False, f"waits: the API says it is {state}")
    address = str(((vm.get("networkInterfaces") or [{}])[0]).get("networkIP") or "")
    if not address:
        return Silent(since, False, "has no address in the API")
    return _at(address, since, "the API says it is RUNNING", knocker)


class Summary:
    """Every worker's reports summed up: RUNNING, why a job still runs (a worker runs one, or is silent and not
    found dead); BUSY, which workers' TPU is held; SINCE, since when every live worker has been idle (a dead one's
    work ended with its last report); SILENT, a line on each silent worker, DEAD among them those found dead, and
    GONE, their names."""

    __slots__ = ("running", "busy", "since", "silent", "dead", "gone")

    def __init__(self) -> None:
        self.running: list[str] = []
        self.busy: list[str] = []
        self.since = 0.0
        self.silent: list[str] = []
        self.dead: list[str] = []
        self.gone: set[str] = set()


def summarize(
    states: list[tuple[str, WatchState | None]], now: float, tick: float, verdicts: dict[str, Silent] | None = None
) -> Summary:
    """Workers' published states (None: nothing, or nothing readable) and the deciding watchdog's VERDICTS on the
    silent ones, summed up."""
    s = Summary()
    verdicts = verdicts or {}
    if not states:
        s.running.append("no worker to look at")
    for name, st in states:
        if st is None or now - st.t > SILENT_TICKS * tick:
            v = verdicts.get(name)
            if v is not None and v.dead:
                s.dead.append(f"{name} dead: silent for {duration(now - v.since)}; its VM {v.vm}")
                s.silent.append(s.dead[-1])
                s.gone.add(name)
                s.since = max(s.since, v.since)
                continue
            said = f"{name} silent for {duration(now - st.t)}" if st is not None else f"{name} has not reported"
            s.running.append(said + (f"; its VM {v.vm}" if v is not None else ""))
            s.silent.append(s.running[-1])
        elif st.jobs:
            s.running.append(f"{name} runs job {st.jobs[0]}")
        elif st.work:
            s.running.append(f"{name} runs tpurun {st.work[0]}")
        elif st.idle_since is None:
            s.busy.append(f"{name}: {st.holders} process(es) hold the TPU")
        else:
            s.since = max(s.since, st.idle_since)
    return s


def verdicts_in(states: list[tuple[str, WatchState | None]]) -> dict[str, Silent]:
    """The deciding watchdog's verdicts on silent workers, as it published them with its own state."""
    found: dict[str, Silent] = {}
    for _, st in states:
        if st is not None:
            found.update(st.silent)
    return found


class Missed:
    """When the deciding watchdog first missed each worker that never reported (its silence has no last report)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def silent_since(self, name: str, st: WatchState | None, tick: float, now: float | None = None) -> float | None:
        """Since when NAME has been silent (None: it is not)."""
        now = time.time() if now is None else now
        if st is not None and now - st.t <= SILENT_TICKS * tick:
            self.first.pop(name, None)
            return None
        return st.t if st is not None else self.first.setdefault(name, now)
