"""What the deciding watchdog finds of a worker whose watchdog went silent (stdlib only, Python >= 3.8; part of
the bundle, beside watchdog.py): when it first missed one that never reported (`Missed`), and what became of its
VM (`node_verdict`, `vm_verdict`: a `Silent` verdict, published with the decider's state).

A worker that has not published its state for SILENT_TICKS ticks may run work its watchdog cannot tell of: it
counts as busy. Past the configuration's bound (`WatchdogConfig.silent`, TPURUN_WATCHDOG_SILENT) the deciding
worker's watchdog asks what became of its VM: the API first (a Cloud TPU node gone, PREEMPTED, TERMINATED or
STOPPED, or unresponsive (health TIMEOUT); a Compute Engine VM gone or not running), and, where the API says the
VM is up (a Cloud TPU node is READY as a whole: the API has no word of one VM of it), whether its address still
takes a connection on the SSH port from inside the slice (`knock`). How a verdict counts when every worker's
reports are summed up is watchdog_reports.py's (`summarize`).
"""

from __future__ import annotations

import socket
import time

if __package__:
    from tpurun.worker.watchdog_reports import SILENT_TICKS, Silent, WatchState
else:
    from watchdog_reports import SILENT_TICKS, Silent, WatchState  # type: ignore[no-redef]

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
