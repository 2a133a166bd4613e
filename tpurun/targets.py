"""Which workers a command acts on: a TPU's workers over SSH, or this machine as a one-host pod."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tpurun import keys, settings, ui
from tpurun.errors import UnreachableError, UsageError
from tpurun.remote import LocalRunner, Runner, SshRunner, Worker, parse_worker_spec


@dataclass
class Target:
    """The selected workers of one TPU (or of this machine), with a runner each."""

    name: str  # TPU name, or "local"
    accelerator_type: str | None
    runners: list[Runner]
    all_workers: list[Worker]  # every worker of the node, selected or not (rank math needs them)
    local: bool

    def close(self) -> None:
        for r in self.runners:
            r.close()


def _mapped(address: str) -> tuple[str, int]:
    """ADDRESS rewritten by TPURUN_ADDRESS_MAP (testing only: JSON {"real_ip": "other_ip[:port]"}), and its port.

    Lets tests and benchmarks put something between tpurun and a worker, e.g. the latency proxy of
    tpurun.testing.latency_proxy; host keys are then checked under the mapped address.
    """
    raw = os.environ.get("TPURUN_ADDRESS_MAP")
    if not raw:
        return address, 22
    try:
        mapping = json.loads(raw)
        to = str(mapping.get(address, address))
        host, _, port = to.partition(":")
        return host, int(port or 22)
    except (ValueError, AttributeError):
        raise UsageError('bad TPURUN_ADDRESS_MAP: give JSON like {"10.0.0.2": "127.0.0.1:2222"}') from None


def resolve(
    *,
    tpu: str | None,
    local: bool,
    worker_spec: str = "all",
    project: str | None = None,
    zone: str | None = None,
    announce: bool = True,
) -> Target:
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone})
    if local and tpu:
        raise UsageError("choose one of --tpu and --local")
    name = None if local else s.tpu.value
    if not name:
        parse_worker_spec(worker_spec, 1)
        if announce:
            why = "--local" if local else "no TPU configured (--tpu, TPURUN_TPU or tpu in tpurun.toml)"
            ui.info(f"running on this machine as a one-host pod ({why})")
        w = Worker(0, "127.0.0.1")
        return Target("local", None, [LocalRunner(w)], [w], True)

    from tpurun.cloud import Cloud
    from tpurun.provision import STATE, validate_name

    validate_name(name)
    cloud = Cloud(s)
    node = cloud.get_node(name)
    state = STATE(node.state).name
    if state != "READY":
        raise UnreachableError(
            f"{name} is {state}, so its workers cannot be reached",
            hint=f"`tpurun describe {name}`" + (f"; `tpurun start {name}`" if state == "STOPPED" else ""),
        )
    user = keys.ssh_user()
    workers = []
    for i, ep in enumerate(node.network_endpoints):
        external = ep.access_config.external_ip if ep.access_config else ""
        address, port = _mapped(external or ep.ip_address)
        workers.append(Worker(i, address, port, user))
    chosen = parse_worker_spec(worker_spec, len(workers))
    home = s.home_path
    runners: list[Runner] = [
        SshRunner(
            workers[i],
            key_path=keys.key_path(home),
            known_hosts=keys.known_hosts_path(home),
            node_name=name,
        )
        for i in chosen
    ]
    return Target(name, node.accelerator_type, runners, workers, False)
