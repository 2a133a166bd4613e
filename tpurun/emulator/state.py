"""The emulator's model of Cloud TPU: nodes, queued resources, long-running operations, capacity.

Everything the HTTP layer (api.py) answers comes from here. Methods take already-parsed proto-plus
messages and return JSON-ready dicts in the real API's shapes, or raise `ApiError` carrying the
HTTP status and Google status name the real service would send.

State changes that take time on the real service (create, stop, start, delete, queued-resource
provisioning) run on background threads with configurable delays; the workers themselves are
booted and stopped through a `WorkerHosts` (hosts.py), which is the only part that touches the OS.
"""

from __future__ import annotations

import re
from typing import Any

from tpurun.emulator.firewalls import Firewalls
from tpurun.emulator.maintenance import Host
from tpurun.emulator.model import ApiError
from tpurun.emulator.org import Organisation


class Emulator(Firewalls):
    """The whole emulated service. Thread-safe: HTTP handler threads and operation threads share it."""

    # ------------------------------------------------------------------ faults and admin

    def check_caller(self, authorization: str, path: str) -> str:
        """Who may call the API. A call without credentials is the emulator's own user (tpurun sends none
        to a local endpoint). A bearer token must be one a node's workers got from their metadata server,
        and acts within that node's project, as a TPU VM's service account does. Returns the caller as the
        request log names it: `vm:NODE`."""
        scheme, _, token = authorization.partition(" ")
        node = self.hosts.node_of_token(token.strip()) if scheme.lower() == "bearer" else None
        if node is None:
            raise ApiError(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or "
                "other valid authentication credential.",
                "UNAUTHENTICATED",
            )
        project = node.split("/")[1]
        m = re.match(r"^/(?:v2|v2alpha1|compute/v1)/projects/([^/]+)/", path)
        if m and m.group(1) != project:
            raise ApiError(
                403,
                f"Permission 'tpu.nodes.get' denied on resource 'projects/{m.group(1)}' (the caller is a service "
                f"account of project {project}).",
                "PERMISSION_DENIED",
            )
        return f"vm:{node}"

    def kill_worker(self, ref: str, index: int, zone: str | None = None) -> None:
        """Fault: worker INDEX of REF (a node, a MIG or a lone VM; as tpurun numbers workers) dies whole."""
        host = self._running_host(ref, index, zone)
        with host.lock:
            self.hosts.kill_worker(host.key, host.worker)
        self.log_event("kill-worker", host.label)
        self._persist_pids()

    def kill_sshd(self, ref: str, index: int, zone: str | None = None) -> None:
        """Fault: worker INDEX of REF takes no new ssh connection; its processes live on."""
        host = self._running_host(ref, index, zone)
        self.hosts.kill_sshd(host.key, host.worker)
        self.log_event("kill-sshd", host.label)

    def _running_host(self, ref: str, index: int, zone: str | None) -> Host:
        host = self._host(ref, index, zone)
        if not host.running:
            state = host.node.state if host.node else host.vm.inst.status  # type: ignore[union-attr]
            raise ApiError(400, f"{host.name} is {state}: its workers are not running.")
        return host

    def node_info(self, ref: str) -> dict[str, Any]:
        rec = self.find_node(ref)
        workers = []
        if rec.booted:
            for w in self.hosts.workers(rec.key):
                workers.append(
                    {
                        "index": w.index,
                        "address": w.address,
                        "hostname": w.hostname,
                        "sshPort": w.ssh_port,
                        "hostKey": w.host_key,
                        "initPid": w.init_pid,
                        "startupLog": str(self.hosts.startup_log(rec.key, w.index)),
                        "rootPids": self.hosts.worker_root_pids(rec.key, w.index),
                        "startupExitCode": self._startup_code(rec.key, w.index),
                    }
                )
        return {"name": rec.node.name, "key": rec.key, "state": rec.state, "slot": rec.slot, "workers": workers}

    def _startup_code(self, key: str, index: int) -> int | None:
        fn = getattr(self.hosts, "startup_exit_code", None)  # optional in the hosts interface
        return fn(key, index) if fn is not None else None

    def status(self) -> dict[str, Any]:
        with self.lock:
            nodes = [
                {
                    "name": r.node.name,
                    "acceleratorType": r.topo.name,
                    "state": r.state,
                    "workers": r.topo.hosts,
                    "addresses": [ep.ip_address for ep in r.node.network_endpoints],
                }
                for r in sorted(self.nodes.values(), key=lambda r: r.node.name)
            ]
            queued = [{"name": q.qr.name, "state": q.state} for q in self.queued.values()]
            return {
                "nodes": nodes,
                "queuedResources": queued,
                "delays": self.config.delays.__dict__,
                "capacity": {f"{z}/{g}": f"{n} {u}" for (z, g), (n, u) in self.config.capacity.limits.items()},
                "maxWorkersPerNode": self.config.max_workers_per_node,
                "failRules": list(self._fail_rules),
                "iapTunnels": self.org.iap.describe(),
                **self.compute_status(),
            }

    def reset(self) -> None:
        """Delete every node, queued resource and Compute Engine resource at once, forget operations, faults, the
        request log, the projects' metadata and the OS Login profiles."""
        self.compute_teardown()
        with self.lock:
            recs = list(self.nodes.values())
        for rec in recs:
            with rec.lock:
                try:
                    self._shutdown(rec, delete=True)
                finally:
                    self._remove(rec)
        with self.lock:
            self.nodes.clear()
            self.queued.clear()
            self.firewalls.clear()
            self.ops.clear()
            self._fail_rules.clear()
            self.request_log.clear()
            self.org = Organisation()
        self.hosts.use_organisation(self.org)
        self._persist_pids()

    def close(self) -> None:
        """Stop background work, shut every worker down and release the hosts."""
        self._closing.set()
        with self.lock:
            # running nodes first: WorkerHosts waits for a stopped node's old pid namespaces to empty,
            # and a namespace inode the kernel reused for a running worker would stall that wait
            recs = sorted(self.nodes.values(), key=lambda r: not r.booted)
            threads = list(self._threads)
        for rec in recs:
            # a boot in progress finishes first (rec.lock), then is torn down
            with rec.lock:
                try:
                    self._shutdown(rec, delete=True)
                except Exception as e:
                    self.log_event("internal-error", f"shutdown {rec.key}: {e}")
        for t in threads:
            t.join(timeout=30)
        self.compute_teardown()
        self.hosts.close()
        with self.lock:
            self.nodes.clear()
        self._persist_pids()
