"""The client of a running emulator's admin interface (ADMIN_PREFIX): what `tpurun emulator`'s fault commands
and the tests' fixtures use. Apart from the server's modules (of the emulator it needs only the model's error and
words), so that a fault command does not load the whole server: its state and Compute Engine's types take
seconds of CPU to import.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from tpurun.emulator.model import UNSCHEDULED, ApiError

ADMIN_PREFIX = "/emulator/v1"


class AdminClient:
    """Talks to a running emulator's /emulator/v1 interface (what `tpurun emulator` fault commands use)."""

    def __init__(self, endpoint: str, timeout: float = 120.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """METHOD ADMIN_PREFIX/PATH; raises ApiError with the server's message on an error answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.endpoint}{ADMIN_PREFIX}/{quote(path, safe='/:')}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read()).get("error", {})
            except ValueError:
                err = {}
            raise ApiError(e.code, str(err.get("message") or e.reason), err.get("status")) from e

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.call("GET", "status")
        return out

    def requests(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.call("GET", "requests")["requests"]
        return out

    def preempt(self, node: str, force: bool = False, notice: float = 0.0) -> dict[str, Any]:
        out: dict[str, Any] = self.call("POST", f"nodes/{node}:preempt", {"force": force, "notice": notice})
        return out

    def preempt_instance(self, instance: str, force: bool = False, notice: float = 0.0) -> dict[str, Any]:
        """Preempt one Compute Engine VM (by name or path) NOTICE seconds after its metadata says so: its worker
        dies, it is TERMINATED."""
        out: dict[str, Any] = self.call("POST", f"instances/{instance}:preempt", {"force": force, "notice": notice})
        return out

    def maintenance(
        self,
        node: str,
        worker: int,
        notice: float,
        duration: float | None = None,
        kind: str = UNSCHEDULED,
        zone: str | None = None,
    ) -> dict[str, Any]:
        """Announce maintenance of NODE's (a node's, a MIG's or an instance's, in ZONE if given) WORKER (as tpurun
        numbers workers) in NOTICE seconds, its host down for DURATION (the emulator's maintenance delay if None);
        the window as the APIs show it."""
        body: dict[str, Any] = {"notice": notice, "type": kind, "zone": zone}
        if duration is not None:
            body["duration"] = duration
        out: dict[str, Any] = self.call("POST", f"nodes/{node}/workers/{worker}:maintenance", body)
        return out

    def kill_worker(self, node: str, worker: int, zone: str | None = None) -> None:
        """Kill worker WORKER (as tpurun numbers workers) of NODE: a node, a MIG or a lone VM, in ZONE if given."""
        self.call("POST", f"nodes/{node}/workers/{worker}:kill", {"zone": zone})

    def kill_sshd(self, node: str, worker: int, zone: str | None = None) -> None:
        self.call("POST", f"nodes/{node}/workers/{worker}:kill-sshd", {"zone": zone})

    def security_code(self, account: str) -> str:
        """ACCOUNT's OS Login one-time password now (2-step verification), as its authenticator shows it."""
        return str(self.call("GET", f"oslogin/{account}:security-code")["code"])

    def oslogin_role(self, account: str, project: str, role: str) -> dict[str, Any]:
        """Give ACCOUNT the OS Login grant ROLE in PROJECT: `login` (roles/compute.osLogin) or `adminLogin`
        (roles/compute.osAdminLogin, every account's until told otherwise)."""
        out: dict[str, Any] = self.call("POST", f"oslogin/{account}:role", {"project": project, "role": role})
        return out

    def iap_access(self, allow: bool, project: str = "") -> dict[str, Any]:
        """Allow or deny tunnels through IAP to PROJECT's VMs (every project's without one); who may, as it stands."""
        out: dict[str, Any] = self.call("POST", "iap", {"allow": allow, "project": project})
        return out

    def fail_api(self, count: int, code: int, match: str = "", message: str = "") -> None:
        self.call("POST", "fail-api", {"count": count, "code": code, "match": match, "message": message})

    def set_delays(self, **delays: float) -> None:
        self.call("POST", "delays", delays)

    def set_capacity(self, specs: list[str], clear: bool = False, max_workers: int | None = None) -> None:
        body: dict[str, Any] = {"specs": specs, "clear": clear}
        if max_workers is not None:
            body["maxWorkersPerNode"] = max_workers
        self.call("POST", "capacity", body)

    def node_info(self, node: str) -> dict[str, Any]:
        out: dict[str, Any] = self.call("GET", f"nodes/{node}")
        return out

    def reset(self) -> None:
        self.call("POST", "reset", {})

    def shutdown(self) -> None:
        self.call("POST", "shutdown", {})
