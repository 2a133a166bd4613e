"""Which workers a command acts on: the TPU the settings name (found through what tpurun remembers of it,
else the cloud API), its workers reached over SSH, or this machine as a one-host pod. Above the transport:
it picks the runners, the transport reaches them."""

from __future__ import annotations

import json
import shlex
import socket
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpurun import config, settings, ui
from tpurun.cloud import identity, keys
from tpurun.cloud.identity import Endpoints
from tpurun.errors import Preempted, TpurunError, UnreachableError, UsageError
from tpurun.fleet.interface import Fleet, connect_all
from tpurun.fleet.relays import Relays
from tpurun.fleet.threads import Threads
from tpurun.naming import NAME_RE
from tpurun.topology import Topology, one_host, parse_accelerator_type, single_host_env, vm_env
from tpurun.transport import iap, proxy_command
from tpurun.transport.local import LocalRunner
from tpurun.transport.runner import INTERNAL_PORT, Runner, Worker, parse_worker_spec, worker_names
from tpurun.transport.ssh import Dial, SshRunner

if TYPE_CHECKING:
    from tpurun.cloud.client import Cloud  # not at run time: exec and train load the API clients only when asked


@dataclass(frozen=True)
class _Places:
    """Each worker's place in its slice, and each slice's addresses inside the VPC: what `Target.vm_env` tells
    every worker, worked out in one pass (not once per worker: a slice reaches thousands of hosts)."""

    workers: list[Worker]
    host: dict[int, int]  # worker index -> its index in its slice
    addresses: dict[int, list[str]]  # slice -> its workers' addresses, in order

    @classmethod
    def of(cls, workers: list[Worker]) -> _Places:
        by_slice: dict[int, list[Worker]] = {}
        for w in workers:
            by_slice.setdefault(w.slice or 0, []).append(w)
        host = {w.index: n for mates in by_slice.values() for n, w in enumerate(mates)}
        return cls(workers, host, {s: [w.internal or w.address for w in mates] for s, mates in by_slice.items()})


@dataclass
class Target:
    """The selected workers of one TPU (or of this machine), with a runner each."""

    name: str  # TPU name, or "local"
    accelerator_type: str | None
    runners: list[Runner]
    all_workers: list[Worker]  # every worker of the node, selected or not (rank math needs them)
    local: bool
    nodes: list[str] = field(default_factory=list)  # the TPU's nodes: one, or one per slice
    ids: list[str] = field(default_factory=list)  # their unique ids in the API: the TPU's identity
    cached: bool = False  # built from remembered endpoints, without an API call
    refresh: Callable[[], Target] | None = field(default=None, repr=False)
    where: settings.Settings | None = field(default=None, repr=False)  # what named the TPU (None: this machine)
    slice_metadata: bool = True  # NodeView.slice_metadata: its VMs tell the runtimes their place themselves
    topology: Topology | None = None  # the accelerator type, parsed once (None on this machine)
    connected: bool = False  # connect() was called
    ways: Ways | None = field(default=None, repr=False)  # how each worker is reached (None: this machine)
    asks: bool = False  # each worker asks the person at the terminal a second factor (OS Login 2FA, a human)
    _places: _Places | None = field(default=None, init=False, repr=False, compare=False)  # vm_env's, of all_workers
    _fleet: Fleet | None = field(default=None, init=False, repr=False, compare=False)
    job_python: str = field(default="", init=False, repr=False, compare=False)  # run_jobs_with's

    @property
    def fleet(self) -> Fleet:
        """The selected workers as a `Fleet`, the one way commands reach them: this process's threads, or relays
        inside the slice (the relay setting: on, off, or auto above TPURUN_RELAY_ABOVE workers)."""
        if self._fleet is None:
            self._fleet = self._relays() if self.relayed else Threads(self)
        return self._fleet

    def _relays(self) -> Relays:
        """Relays for these workers: the roots get tpurun's key, every relay the keys pinned for its children."""
        assert self.where is not None
        home = self.where.home_path
        path = keys.key_path(home)
        if not path.exists():
            raise UsageError(f"no ssh key of tpurun's at {path}", hint=f"`tpurun attach {self.name}` makes one")
        python = self.job_python or self.python()
        return Relays(self, key=path.read_text(), pins=lambda: keys.pinned_keys(home), python=python)

    def run_jobs_with(self, python: str) -> None:
        """A job's Python, named before the fleet is made: the relays run with it too, so that a relay's zygote can
        fork the job's agent rather than start another interpreter (worker/zygote.py)."""
        if self._fleet is None:
            self.job_python = python

    @property
    def relayed(self) -> bool:
        """Whether commands reach these workers through relays inside the slice."""
        if self.local or self.where is None:
            return False
        mode = self.where.relay_mode
        if self.asks:  # a relay logs in to its children with nobody to answer their second step: straight to each
            if mode == "on":
                raise UsageError(
                    f"{self.name}'s workers ask you for a second factor (OS Login 2-step verification) at every "
                    "login, which relays cannot answer",
                    hint="--no-relay (tpurun asks you once per worker), or act as a service account (not asked)",
                )
            return False
        if mode == "auto":
            try:
                above = config.RELAY_ABOVE.integer()
            except ValueError:
                raise UsageError("TPURUN_RELAY_ABOVE must be a whole number of workers") from None
            return len(self.runners) > above
        return mode == "on"

    @property
    def alone(self) -> Topology | None:
        """The single-host slice this target's one selected worker is on its own, where it is one host of a
        one-slice multi-host TPU (`train --worker N`, `exec` on one worker): its runtimes are given that
        slice's values instead of what the VM's metadata says of the whole slice. None otherwise."""
        topo = self.topology
        if topo is None or not topo.multi_host or len(self.runners) != 1 or self.slices > 1:
            return None
        return one_host(topo)

    def vm_env(self, worker: Worker) -> dict[str, str]:
        """What the runtimes on WORKER must be told of its place because its VM's metadata does not say it
        (a Compute Engine VM), or says the whole slice's where the worker runs alone (`alone`); {} where the
        metadata is right. Every process tpurun starts on a worker gets it (topology.vm_env)."""
        if self.alone is not None:
            return single_host_env(self.alone, worker.internal or worker.address)
        if self.topology is None or self.slice_metadata:
            return {}
        places = self._places
        if places is None or places.workers is not self.all_workers:  # worked out once per set of workers
            places = self._places = _Places.of(self.all_workers)
        slice_id = worker.slice or 0
        return vm_env(
            self.topology,
            places.host[worker.index],
            places.addresses[slice_id],
            slices=len(places.addresses),
            slice_id=slice_id,
        )

    @property
    def workers(self) -> list[Worker]:
        """The selected workers, in order: what a caller counts, names and addresses in its messages (reaching
        them is the fleet's). Read anew each time: `connect` may find the TPU made anew, with other workers."""
        return [r.worker for r in self.runners]

    @property
    def worker_names(self) -> dict[int, str]:
        """How each worker is shown: w3, or s1/w1 in a multislice TPU."""
        return worker_names(self.all_workers)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def project(self) -> str:
        """The project the TPU is in ("" for this machine)."""
        return (self.where.project.value or "") if self.where else ""

    @property
    def zone(self) -> str:
        return (self.where.zone.value or "") if self.where else ""

    def cloud(self) -> Cloud:
        """The APIs where the TPU is (a named TPU only)."""
        from tpurun.cloud.client import Cloud

        assert self.where is not None, "this machine has no Cloud TPU API"
        return Cloud(self.where)

    @property
    def slices(self) -> int:
        """How many slices the TPU has (1 unless it is a multislice TPU)."""
        return len({w.slice for w in self.all_workers})

    def other_than(self, ids: list[str]) -> bool:
        """Whether this is known to be another TPU than the one whose nodes had IDS (a name made anew)."""
        return bool(ids) and bool(self.ids) and list(ids) != self.ids

    def python(self, chosen: str | None = None) -> str:
        """CHOSEN, else the workers' Python when none is named (this machine: the one tpurun runs in)."""
        return chosen or self.runners[0].python

    def close(self) -> None:
        for r in self.runners:
            r.close()

    def proxy_command(self, worker: Worker) -> str | None:
        """The ProxyCommand with which the system ssh reaches WORKER as tpurun does (`Ways.proxy_command`)."""
        return self.ways.proxy_command(worker) if self.ways is not None else None

    def connect(
        self, then: Callable[[Runner], None] | None = None, *, only: Collection[int] | None = None
    ) -> dict[int, str]:
        """Connect every runner at once (of ONLY: the workers a relay tree is reached through); {worker: error}
        for those that failed.

        Every connection checks the worker's host key under the TPU's identity (its node's unique id), so a
        worker reached is that worker of that TPU. Remembered endpoints save the API call (and importing its
        client) on every command; as soon as a worker cannot be reached or does not prove who it is, the API
        is asked: a TPU deleted, preempted or stopped since is reported as such (raised), one made anew
        under the same name is used with its own workers, and a worker refused for its key gets one more
        try with the keys the API publishes now.
        """
        self.connected = self.connected or only is None

        def chosen(runners: list[Runner]) -> list[Runner]:
            return [r for r in runners if only is None or r.worker.index in only]

        errors = connect_all(chosen(self.runners), then)
        if not errors or not self.cached or self.refresh is None:
            return errors
        fresh = self.refresh()  # raises when the TPU is gone or not READY any more
        if fresh.all_workers == self.all_workers:  # the same TPU at the same addresses
            fresh.close()
            again = [r for r in self.runners if r.worker.index in errors and r.refused_key]
            for r in again:
                r.close()
            retried = connect_all(again, then)
            return {i: e for i, e in errors.items() if i not in {r.worker.index for r in again}} | retried
        # a worker that proved who it is at the address the API gives now stays connected (THEN ran on it once)
        kept = {r.worker: r for r in self.runners if r.worker.index not in errors}
        runners = [kept.pop(r.worker) if r.worker in kept else r for r in fresh.runners]
        for r in [*kept.values(), *(r for r in fresh.runners if r not in runners)]:
            r.close()
        self.runners, self.all_workers, self.nodes, self.cached = runners, fresh.all_workers, fresh.nodes, False
        self.ids, self.accelerator_type, self.slice_metadata = fresh.ids, fresh.accelerator_type, fresh.slice_metadata
        self.topology, self.ways = fresh.topology, fresh.ways
        return connect_all(chosen([r for r in runners if r in fresh.runners]), then)


def _mapped(address: str) -> tuple[str, int]:
    """ADDRESS rewritten by TPURUN_ADDRESS_MAP (testing only: JSON {"real_ip": "other_ip[:port]"}), and its port.

    Lets tests and benchmarks put something between tpurun and a worker, e.g. the latency proxy of
    tpurun.testing.latency_proxy; host keys are still checked under the worker's identity.
    """
    raw = config.ADDRESS_MAP.raw()
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
    s: settings.Settings,
    *,
    local: bool = False,
    worker_spec: str = "all",
    announce: Callable[[str], None] | None = None,
) -> Target:
    """The workers of the TPU S names that WORKER_SPEC selects, or with LOCAL (or no TPU named) this machine,
    which ANNOUNCE is told of (a one-host pod): a command that can run on this machine (it has --local) gives
    ANNOUNCE. The TPU is looked for in S's zone, or where tpurun made it when S's zone is only a default
    (`identity.where`)."""
    if local and s.tpu.value and s.tpu.layer is settings.Layer.FLAG:
        raise UsageError("choose one of --tpu and --local")
    name = None if local else s.tpu.value
    if not name:
        parse_worker_spec(worker_spec, 1)
        if announce is not None:
            why = "--local" if local else "no TPU configured (--tpu, TPURUN_TPU or tpu in tpurun.toml)"
            announce(f"running on this machine as a one-host pod ({why})")
        w = Worker(0, "127.0.0.1")
        return Target("local", None, [LocalRunner(w)], [w], True)

    from tpurun.naming import validate_name

    validate_name(name)
    s = identity.where(s, name)
    try:
        project, zone = s.require_location()
    except UsageError as exc:
        raise UsageError(
            f"{exc.message}; or run on this machine with --local (the TPU {name!r} comes from {s.tpu.source})"
        ) from None
    file = identity.path(s.home_path, project, zone, name)
    remembered = identity.read(file)

    def from_api() -> Target:
        endpoints = _fetch(s, name, local=announce is not None)
        identity.remember(file, endpoints)
        return _build(s, name, endpoints, worker_spec, cached=False)

    if remembered is None or remembered.endpoints is None or Ways(s).needs_names(remembered.endpoints):
        return from_api()
    # used as remembered: every worker reached proves in its SSH handshake that it is that worker of that
    # TPU (its host key is pinned under the node's unique id); Target.connect asks the API when one cannot
    target = _build(s, name, remembered.endpoints, worker_spec, cached=True)
    target.refresh = from_api
    return target


def _fetch(s: settings.Settings, name: str, *, local: bool) -> Endpoints:
    """Where NAME's workers are (every slice's, for a multislice TPU), if each of its slices is READY, with
    their host keys pinned again from the API under their identities (LOCAL: the command has --local, which
    the error for a TPU that does not exist then suggests)."""
    from tpurun.cloud import provision, routing
    from tpurun.cloud.client import Cloud

    cloud = Cloud(s)
    found = routing.locate(cloud, name)
    if found is None:
        raise cloud.no_such_tpu(name, s.tpu, local=local)
    view = found[1]
    if view.gone:
        raise UnreachableError(
            f"{name}: slice {view.gone[0]} does not exist ({view.state}), so its workers cannot be reached",
            hint=f"`tpurun describe {name}`",
        )
    for i, part in enumerate(view.parts):
        _check_ready(s, name, part.state, f" (slice {i})" if view.multislice else "")
    provision.pin_host_keys(cloud, s.home_path, view)
    from tpurun.cloud import oslogin

    return Endpoints.of(view, oslogin.policy_of(cloud, view.metadata))


def _check_ready(s: settings.Settings, name: str, state: str, what: str = "") -> None:
    """Refuse a TPU whose slice (WHAT says which, of the TPU NAME) is in STATE, unless READY."""
    # here, not at the top: the views pull in autostop and the worker's watchdog (50 ms), which a command on
    # remembered endpoints never needs
    from tpurun.cloud.views import PREEMPTED, READY, STOPPED

    if state == READY:
        return
    default = f" (the default TPU here, from {s.tpu.source})" if s.tpu.default else ""
    if state == PREEMPTED:
        raise Preempted(
            f"{name}{what}{default} was preempted: its VMs are gone",
            tpu=name,
            hint=f"`tpurun delete {name}` and create it again (`train --max-restarts N` does that for a job)",
        )
    hint = f"`tpurun describe {name}`" + (f"; `tpurun start {name}`" if state == STOPPED else "")
    raise UnreachableError(f"{name}{what}{default} is {state}, so its workers cannot be reached", hint=hint)


def names_a_tpu(s: settings.Settings, word: str, *, ask: bool = False) -> bool:
    """Whether WORD is the name of a TPU tpurun remembers in S's project (in any zone, deleted or not), or, with
    ASK, of one the API has where S (or tpurun's record) puts it. Nothing that cannot be asked is one."""
    project = s.project.value
    if not NAME_RE.match(word) or not project:
        return False
    if identity.records(s.home_path, project, word):
        return True
    if not ask:
        return False
    from tpurun.cloud import routing
    from tpurun.cloud.client import Cloud

    try:
        return routing.locate(Cloud(identity.where(s, word)), word) is not None
    except TpurunError:
        return False


def _build(s: settings.Settings, name: str, endpoints: Endpoints, worker_spec: str, *, cached: bool) -> Target:
    user, renew, hint, retries, asks = keys.ssh_user(), None, "", {}, False
    if endpoints.login.oslogin:  # the workers let in the POSIX user of the profile tpurun's key is imported into
        from tpurun.cloud import oslogin

        login = oslogin.Login(s, name, endpoints.login)
        user, renew = login.user(), login.user
        hint = f"tpurun's key is in the OS Login profile of {login.account()}; {oslogin.ROLE_HINT}"
        retries = {"auth_retries": 1}  # a key in the profile counts at once: no metadata to wait for
        asks = login.asks_person()  # 2-step verification: each worker asks the person at the terminal (ui.ask)
    ways = Ways(s)
    workers: list[Worker] = []
    for slice_id, slice_endpoints in enumerate(endpoints.slices):
        for host, (internal, external, alias, instance) in enumerate(slice_endpoints):
            address, port = ways.place(len(workers), internal, external, instance)
            where = slice_id if endpoints.multislice else None
            workers.append(
                Worker(len(workers), address, port, user, slice=where, host=host, internal=internal, host_key=alias)
            )
    chosen = parse_worker_spec(worker_spec, len(workers), [w.name for w in workers] if endpoints.multislice else None)
    key, known = keys.key_path(s.home_path), keys.known_hosts_path(s.home_path)
    runners: list[Runner] = []
    for i in chosen:
        dial, through = ways.dial(workers[i])
        runners.append(
            SshRunner(workers[i], key_path=key, known_hosts=known, node_name=name, renew=renew, login_hint=hint,
                      dial=dial, through=through, answered=ways.answered(workers[i]), reach_hint=ways.hint(workers[i]),
                      ask=ui.ask if asks else None, **retries)
        )  # fmt: skip
    return Target(
        name,
        endpoints.accelerator_type,
        runners,
        workers,
        False,
        nodes=endpoints.nodes,
        ids=endpoints.ids,
        cached=cached,
        where=s,
        slice_metadata=endpoints.slice_metadata,
        topology=parse_accelerator_type(endpoints.accelerator_type),
        ways=ways,
        asks=asks,
    )


class Ways:
    """How this machine reaches a TPU's workers, by the `via` setting: straight to each one's address (its external
    one, else its internal one), through IAP's tunnel to its VM's instance (`auto`'s way to a worker without an
    external address), or through the user's ProxyCommand to its internal address. One per target: its workers'
    tunnels share one token."""

    def __init__(self, s: settings.Settings) -> None:
        self.s, self.way = s, s.via_way
        self._tunnels: iap.Tunnels | None = None
        self.ends: dict[int, tuple[str, str]] = {}  # each worker's (external address, instance name), once placed

    def tunnelled(self, external: str) -> bool:
        """Whether a worker whose external address is EXTERNAL ("": none) is reached through IAP."""
        return self.way == "iap" or (self.way == "auto" and not external)

    def straight(self, external: str) -> bool:
        return self.way == "direct" or (self.way == "auto" and bool(external))

    def place(self, index: int, internal: str, external: str, instance: str) -> tuple[str, int]:
        """The address and port worker INDEX (its addresses INTERNAL and EXTERNAL, its VM's INSTANCE) is known by
        here: where tpurun dials it (TPURUN_ADDRESS_MAP applied), or its internal address and sshd's port there,
        which a tunnel or a ProxyCommand reaches."""
        self.ends[index] = (external, instance)
        if self.straight(external):
            return _mapped(external or internal)
        return internal, INTERNAL_PORT

    def needs_names(self, endpoints: Endpoints) -> bool:
        """Whether a worker of ENDPOINTS goes through IAP and its instance name is not known (an old record)."""
        return any(self.tunnelled(ext) and not inst for part in endpoints.slices for _, ext, _, inst in part)

    def dial(self, worker: Worker) -> tuple[Dial | None, str]:
        """What opens the byte stream to WORKER (placed), None for a TCP connection to its address; and how messages
        name that way."""
        external, instance = self.ends[worker.index]
        if self.straight(external):
            return None, ""
        if not self.tunnelled(external):  # the user's ProxyCommand
            command = proxy_command.expand(self.way, worker.internal, INTERNAL_PORT, worker.user)
            return (lambda timeout: proxy_command.ProxySocket(command)), f"through `{self.way}`"
        if self._tunnels is None:
            self._tunnels = _tunnels(self.s)
        tunnels, project, zone = self._tunnels, self.s.project.value or "", self.s.zone.value or ""

        def tunnel(timeout: float) -> socket.socket:
            if not instance:
                raise UnreachableError(
                    f"worker {worker.label()} goes through IAP, which needs its VM's instance name, and the API does "
                    "not say it (a Cloud TPU worker publishes it as its `hostname` guest attribute)",
                    hint="guest attributes must be readable: the organisation policy "
                    "compute.disableGuestAttributesAccess must not be on; or reach it another way (--via)",
                )
            return tunnels.open(iap.Instance(project, zone, instance), worker.name, timeout)

        return tunnel, "through IAP"

    def answered(self, worker: Worker) -> str:
        """What answered for WORKER (placed) when its host key is not the one its TPU published, where its way is
        not its address ("": the VM at its address, the runner's own words): the VM IAP reached by its instance
        name, or whatever the user's ProxyCommand reached."""
        external, instance = self.ends[worker.index]
        if self.straight(external):
            return ""
        if not self.tunnelled(external):
            return (
                f"what `{self.way}` reached for it does not hold the key the TPU published for that worker: the "
                "command reaches another host, or a man in the middle"
            )
        return (
            f"the VM that IAP's tunnel reached as instance {instance} does not hold the key the TPU published for "
            "that worker: another VM holds that instance name now, or the VM's host key was replaced"
        )

    def hint(self, worker: Worker) -> str:
        """What to do when WORKER (placed) cannot be reached, where its way says more than `tpurun describe`."""
        external, _ = self.ends[worker.index]
        if self.straight(external) and not external:
            return (
                "it has no external address: only its network reaches it there, and IAP from outside "
                "(--via iap; docs/locked-down.md)"
            )
        return ""

    def proxy_command(self, worker: Worker) -> str | None:
        """The ProxyCommand with which OpenSSH reaches WORKER (placed) the way tpurun does (`tpurun ssh`), None where
        it dials the worker's address: the user's own, or tpurun itself carrying ssh's bytes through IAP's tunnel
        (`tpurun iap-tunnel`)."""
        external, instance = self.ends[worker.index]
        if self.straight(external):
            return None
        if not self.tunnelled(external):
            return self.way
        argv = [sys.executable, "-m", "tpurun", "iap-tunnel", instance or "-", "%p"]
        return shlex.join(argv + ["--project", self.s.project.value or "", "--zone", self.s.zone.value or ""])

    def open_tunnel(self, instance: str, port: int, timeout: float) -> socket.socket:
        """A tunnel through IAP to port PORT of INSTANCE in the settings' project and zone (`tpurun iap-tunnel`)."""
        if self._tunnels is None:
            self._tunnels = _tunnels(self.s)
        where = iap.Instance(self.s.project.value or "", self.s.zone.value or "", instance, port)
        return self._tunnels.open(where, "", timeout)


def _tunnels(s: settings.Settings) -> iap.Tunnels:
    """IAP's tunnels beside S's API endpoint, with its credentials; the account they act as named in a refusal."""
    from tpurun.cloud import services

    def account(creds: object) -> str:
        from tpurun.cloud import oslogin

        return oslogin.acting_account(s, creds)[0]

    endpoint = s.endpoint
    return iap.Tunnels(services.tunnel_url(endpoint), lambda: services.credentials(endpoint), account)
