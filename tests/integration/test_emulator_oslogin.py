"""The emulator as an organisation that enforces OS Login: project metadata through google-cloud-compute's
ProjectsClient, profiles and keys through google-cloud-os-login's OsLoginServiceClient, and real logins
(paramiko) to the workers of one shared v4-16 node, whose sshd asks its metadata server who may come in.

Everything here happens in a project of its own, so no other test's TPU meets its OS Login."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import re
import shlex
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.api_core import exceptions as gx
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, oslogin_v1, tpu_v2
from google.cloud.oslogin_v1 import common

from tpurun.emulator.admin_client import AdminClient
from tpurun.emulator.pytest_plugin import fast_polling
from tpurun.topology import default_runtime_version

pytestmark = pytest.mark.integration

PROJECT = "oslogin-org"
ZONE = "us-central2-b"
ALICE = "alice@example.com"
RUNNER = f"runner@{PROJECT}.iam.gserviceaccount.com"
T = TypeVar("T")


class Key:
    """An ed25519 key pair: the public line OS Login and metadata take, the private key paramiko logs in with."""

    def __init__(self, comment: str = "test") -> None:
        private = Ed25519PrivateKey.generate()
        pem = private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ).decode()
        self.pkey = paramiko.Ed25519Key.from_private_key(io.StringIO(pem))
        line = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        self.public = f"{line.decode()} {comment}"
        self.fingerprint = hashlib.sha256(base64.b64decode(self.public.split()[1])).hexdigest()


@dataclass
class Pod:
    emulator: Any
    name: str
    workers: list[tuple[str, paramiko.PKey]]  # each worker's address and the host key getGuestAttributes published
    meta_key: Key  # listed under `tpurun:` in the node's ssh-keys
    tpu: Any  # tpu_v2.TpuClient
    oslogin: Any  # oslogin_v1.OsLoginServiceClient
    projects: Any  # compute_v1.ProjectsClient

    def transport(self, worker: int | tuple[str, paramiko.PKey]) -> paramiko.Transport:
        address, host_key = self.workers[worker] if isinstance(worker, int) else worker
        t = paramiko.Transport((address, 22))
        t.start_client(timeout=10)
        assert t.get_remote_server_key() == host_key
        return t

    def login(
        self, user: str, key: Key, command: str = "echo $USER; id -u", worker: int | tuple[str, paramiko.PKey] = 1
    ) -> str | None:
        """COMMAND's output as USER logged in with KEY's publickey alone on WORKER (an index, or an address and its
        host key), or None when the worker refuses it."""
        with self.session(user, key, worker) as run:
            return None if run is None else run(command)

    @contextlib.contextmanager
    def session(
        self, user: str, key: Key, worker: int | tuple[str, paramiko.PKey] = 1
    ) -> Iterator[Callable[[str], str] | None]:
        """A login as USER with KEY's publickey alone: a function that runs a command there and returns its
        output, or None when the worker refuses the login."""
        t = self.transport(worker)
        try:
            try:
                t.auth_publickey(user, key.pkey)
            except paramiko.AuthenticationException:
                yield None
                return
            if not t.is_authenticated():
                yield None  # a further step is asked for (2FA)
                return

            def run(command: str) -> str:
                chan = t.open_session()
                chan.exec_command(command)
                out = chan.makefile("rb").read().decode()
                assert chan.recv_exit_status() == 0, out
                return out

            yield run
        finally:
            t.close()

    def metadata(self, items: dict[str, str]) -> None:
        """The project's common metadata replaced by ITEMS (with its current fingerprint), the operation waited."""
        current = self.projects.get(project=PROJECT).common_instance_metadata
        resource = compute_v1.Metadata(
            fingerprint=current.fingerprint, items=[compute_v1.Items(key=k, value=v) for k, v in items.items()]
        )
        self.projects.set_common_instance_metadata(project=PROJECT, metadata_resource=resource).result(timeout=30)

    def node_metadata(self, items: dict[str, str]) -> None:
        node = tpu_v2.Node(name=self.name, metadata={"ssh-keys": f"tpurun:{self.meta_key.public}", **items})
        self.tpu.update_node(node=node, update_mask="metadata").result(polling=fast_polling())

    def import_key(self, email: str, key: Key | str, expiry_usec: int = 0) -> Any:
        text = key.public if isinstance(key, Key) else key
        ssh_key = common.SshPublicKey(key=text, expiration_time_usec=expiry_usec)
        return self.oslogin.import_ssh_public_key(parent=f"users/{email}", ssh_public_key=ssh_key, project_id=PROJECT)


def host_key(published: str) -> paramiko.PKey:
    """A worker's host key from its guest attribute `hostkeys/ssh-ed25519` (the base64 key alone)."""
    return paramiko.Ed25519Key(data=base64.b64decode(published))


def until(what: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0) -> T:
    """WHAT's answer once DONE says so: metadata reaches the workers after the emulator's propagation delay."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pod(emulator) -> Iterator[Pod]:
    """A v4-16 (two workers) in project PROJECT, whose metadata enables OS Login; a metadata key on the node."""
    options = ClientOptions(api_endpoint=emulator.endpoint)
    kw = {"credentials": AnonymousCredentials(), "client_options": options}
    projects = compute_v1.ProjectsClient(**kw)
    # the client's own operation polls compute.googleapis.com: its global operations asked here (as tpurun does)
    projects._transport._extended_operations_services["global_operations"] = compute_v1.GlobalOperationsClient(**kw)
    oslogin = oslogin_v1.OsLoginServiceClient(transport="rest", **kw)
    tpu = emulator.client()
    parent = f"projects/{PROJECT}/locations/{ZONE}"
    meta_key = Key("metadata")
    node = tpu_v2.Node(
        accelerator_type="v4-16",
        runtime_version=default_runtime_version("v4"),
        metadata={"ssh-keys": f"tpurun:{meta_key.public}"},
        network_config=tpu_v2.NetworkConfig(enable_external_ips=True),  # logged in to from this machine
    )
    ready = tpu.create_node(parent=parent, node_id="org", node=node).result(polling=fast_polling())
    name = f"{parent}/nodes/org"
    attrs = tpu.get_guest_attributes(request={"name": name, "query_path": "hostkeys/"})
    host_keys = [host_key(next(i.value for i in ga.query_value.items)) for ga in attrs.guest_attributes]
    workers = [(ep.ip_address, k) for ep, k in zip(ready.network_endpoints, host_keys, strict=True)]
    p = Pod(emulator, name, workers, meta_key, tpu, oslogin, projects)
    p.metadata({"enable-oslogin": "TRUE"})
    try:
        yield p
    finally:
        tpu.delete_node(name=name).result(polling=fast_polling())
        p.metadata({})


def test_project_metadata_is_replaced_with_its_fingerprint(pod):
    before = pod.projects.get(project=PROJECT)
    assert before.name == PROJECT and before.kind == "compute#project" and before.id > 0
    assert before.common_instance_metadata.kind == "compute#metadata"
    pod.metadata({"enable-oslogin": "TRUE", "team": "ml"})
    after = pod.projects.get(project=PROJECT).common_instance_metadata
    assert {i.key: i.value for i in after.items} == {"enable-oslogin": "TRUE", "team": "ml"}
    assert after.fingerprint != before.common_instance_metadata.fingerprint
    stale = compute_v1.Metadata(fingerprint=before.common_instance_metadata.fingerprint, items=[])
    with pytest.raises(gx.PreconditionFailed, match="Supplied fingerprint does not match current metadata"):
        pod.projects.set_common_instance_metadata(project=PROJECT, metadata_resource=stale)
    # every worker's metadata server serves the project's metadata

    def ask(path: str) -> str:
        url = f"http://{pod.workers[0][0]}/computeMetadata/v1/{path}"
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})) as r:
            return str(r.read().decode())

    assert ask("project/attributes/team") == "ml"
    assert ask("project/project-id") == PROJECT
    assert ask("project/numeric-project-id") == str(before.id)
    tree = json.loads(ask("?recursive=true"))
    assert tree["project"]["attributes"] == {"enable-oslogin": "TRUE", "team": "ml"}
    pod.metadata({"enable-oslogin": "TRUE"})


def test_an_imported_key_logs_in_as_the_accounts_posix_user(pod):
    key = Key()
    profile = pod.import_key(ALICE, key).login_profile
    (account,) = profile.posix_accounts
    assert (account.username, account.home_directory, account.account_id) == (
        "alice_example_com",
        "/home/alice_example_com",
        PROJECT,
    )
    assert account.primary and account.uid == account.gid > 65535
    assert account.name == f"users/{ALICE}/projects/{PROJECT}"
    assert account.operating_system_type == common.OperatingSystemType.LINUX
    assert profile.ssh_public_keys[key.fingerprint].key == key.public  # SHA-256 of the key's blob, in hex
    assert re.fullmatch(r"\d{21}", profile.name)  # the account's unique id
    got = pod.oslogin.get_login_profile(request={"name": f"users/{ALICE}", "project_id": PROJECT})
    assert got.posix_accounts[0].username == "alice_example_com" and key.fingerprint in got.ssh_public_keys
    # alice_example_com is an alias of root on every worker, let in by its OS Login key
    assert pod.login("alice_example_com", key) == "alice_example_com\n0\n"
    assert pod.login("alice_example_com", key, worker=0) == "alice_example_com\n0\n"


def test_metadata_keys_are_refused_under_os_login_and_taken_again_without(pod):
    key = Key()
    pod.import_key(ALICE, key)
    assert pod.login("tpurun", pod.meta_key) is None  # the node's ssh-keys: not while the project enables OS Login
    # the node's own metadata comes first: FALSE there turns OS Login off for its workers alone
    pod.node_metadata({"enable-oslogin": "false"})
    assert until(lambda: pod.login("tpurun", pod.meta_key), bool) == "tpurun\n0\n"
    assert pod.login("alice_example_com", key) is None
    pod.node_metadata({})  # the project's TRUE again
    assert until(lambda: pod.login("tpurun", pod.meta_key), lambda got: got is None) is None
    assert pod.login("alice_example_com", key) == "alice_example_com\n0\n"


def test_an_expired_key_is_kept_and_refused(pod):
    key = Key()
    expiry = int((time.time() - 60) * 1_000_000)
    pod.import_key(ALICE, key, expiry)
    listed = pod.oslogin.get_login_profile(request={"name": f"users/{ALICE}"}).ssh_public_keys
    assert listed[key.fingerprint].expiration_time_usec == expiry
    assert pod.login("alice_example_com", key) is None
    pod.oslogin.update_ssh_public_key(
        name=f"users/{ALICE}/sshPublicKeys/{key.fingerprint}",
        ssh_public_key=common.SshPublicKey(expiration_time_usec=int((time.time() + 600) * 1_000_000)),
        update_mask={"paths": ["expiration_time_usec"]},
    )
    assert pod.login("alice_example_com", key) == "alice_example_com\n0\n"


def test_a_deleted_key_logs_in_no_more(pod):
    key = Key()
    pod.import_key(ALICE, key)
    assert pod.login("alice_example_com", key) is not None
    name = f"users/{ALICE}/sshPublicKeys/{key.fingerprint}"
    assert pod.oslogin.get_ssh_public_key(name=name).key == key.public
    pod.oslogin.delete_ssh_public_key(name=name)
    assert pod.login("alice_example_com", key) is None
    with pytest.raises(gx.NotFound):
        pod.oslogin.get_ssh_public_key(name=name)


def test_a_service_account_logs_in_as_sa_and_its_id(pod):
    key = Key()
    (account,) = pod.import_key(RUNNER, key).login_profile.posix_accounts
    assert re.fullmatch(r"sa_\d{21}", account.username)
    assert pod.login(account.username, key) == f"{account.username}\n0\n"
    # its POSIX account deleted, it is nobody on the workers
    pod.oslogin.delete_posix_account(name=f"users/{RUNNER}/projects/{PROJECT}")
    assert pod.login(account.username, key) is None
    pod.import_key(RUNNER, key)


def test_the_metadata_server_answers_as_guest_oslogin_asks(pod):
    key = Key()
    name = pod.import_key(ALICE, key).login_profile.name
    with pod.session("alice_example_com", key) as run:
        assert run is not None

        def curl(path: str) -> tuple[int, str]:
            """A real request from inside the worker, with the header, as guest-oslogin sends it."""
            url = shlex.quote(f"http://metadata.google.internal/computeMetadata/v1/oslogin/{path}")
            out = run(f"curl -s -w '\\n%{{http_code}}' -H 'Metadata-Flavor: Google' {url}")
            body, _, code = out.rstrip("\n").rpartition("\n")
            return int(code), body

        code, body = curl("users?username=alice_example_com")
        (profile,) = json.loads(body)["loginProfiles"]
        assert code == 200 and profile["name"] == name
        assert [a["username"] for a in profile["posixAccounts"]] == ["alice_example_com"]
        assert profile["sshPublicKeys"][key.fingerprint]["key"] == key.public
        uid = profile["posixAccounts"][0]["uid"]
        assert json.loads(curl(f"users?uid={uid}")[1])["loginProfiles"][0]["name"] == name
        assert curl("users?username=nobody_example_com")[0] == 404
        for policy in ("login", "adminLogin"):  # every emulated account may log in and use sudo, by default
            assert curl(f"authorize?email={name}&policy={policy}") == (200, '{"success": true}')
        pod.emulator.admin.oslogin_role(ALICE, PROJECT, "login")  # the login role alone: no sudo
        try:
            assert curl(f"authorize?email={name}&policy=adminLogin") == (200, '{"success": false}')
            assert curl(f"authorize?email={name}&policy=login") == (200, '{"success": true}')
        finally:
            pod.emulator.admin.oslogin_role(ALICE, PROJECT, "adminLogin")
        assert curl("authorize?email=alice%40example.com&policy=login") == (200, '{"success": true}')
        assert curl("authorize?email=mallory%40example.com&policy=login") == (200, '{"success": false}')
        pages = [json.loads(curl("users?pagesize=1")[1])]
        while "loginProfiles" in pages[-1]:
            pages.append(json.loads(curl(f"users?pagesize=1&pagetoken={pages[-1]['nextPageToken']}")[1]))
        assert pages[-1] == {"nextPageToken": "0"}  # the end, as the guest's NSS cache reads it
        assert [len(p["loginProfiles"]) for p in pages[:-1]] == [1] * (len(pages) - 1) and len(pages) >= 3


def test_two_factor_asks_a_human_for_a_second_step(pod):
    human, robot = Key(), Key()
    pod.import_key(ALICE, human)
    sa = pod.import_key(RUNNER, robot).login_profile.posix_accounts[0].username
    pod.metadata({"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"})

    def remaining() -> list[str]:
        t = pod.transport(1)
        try:
            return list(t.auth_publickey("alice_example_com", human.pkey))
        finally:
            t.close()

    def second_step(code: str) -> tuple[bool, list[tuple[str, bool]]]:
        """Whether the worker lets ALICE in with her key and CODE, and what it asked."""
        asked: list[tuple[str, bool]] = []

        def handler(title: str, instructions: str, prompts: list[tuple[str, bool]]) -> list[str]:
            asked.extend(prompts)
            return [code] * len(prompts)

        t = pod.transport(1)
        try:
            t.auth_publickey("alice_example_com", human.pkey)
            try:
                t.auth_interactive("alice_example_com", handler)
            except paramiko.AuthenticationException:
                pass
            return t.is_authenticated(), asked
        finally:
            t.close()

    assert until(remaining, bool) == ["keyboard-interactive"]  # the key was right; a second step is asked
    assert pod.login("alice_example_com", human) is None  # the key alone does not let her in
    code = AdminClient(pod.emulator.endpoint).security_code(ALICE)
    assert re.fullmatch(r"\d{6}", code), code
    assert second_step(code) == (True, [("Enter your one-time password: ", True)])  # pam_oslogin_login's words
    assert second_step("not-a-code")[0] is False
    assert pod.login(sa, robot) == f"{sa}\n0\n"  # a service account: its key alone
    pod.metadata({"enable-oslogin": "TRUE"})
    assert until(lambda: pod.login("alice_example_com", human), bool) is not None


def test_a_profile_past_32_kib_is_refused(pod):
    email = "bob@example.com"
    imported = 0
    with pytest.raises(gx.BadRequest, match=r"Login profile size exceeds 32 KiB\. Delete profile values"):
        while imported < 1000:
            pod.import_key(email, Key())
            imported += 1
    assert imported > 50  # ed25519 keys of a short comment: some 90 fit
    keys = pod.oslogin.get_login_profile(name=f"users/{email}").ssh_public_keys
    assert len(keys) == imported  # the refused key is not there
    for fp in keys:
        pod.oslogin.delete_ssh_public_key(name=f"users/{email}/sshPublicKeys/{fp}")


def test_bad_keys_and_unknown_ones_are_refused(pod):
    with pytest.raises(gx.BadRequest):
        pod.import_key(ALICE, "ssh-ed25519 not-base64 x")
    with pytest.raises(gx.NotFound):
        pod.oslogin.delete_ssh_public_key(name=f"users/{ALICE}/sshPublicKeys/{'0' * 64}")


def test_a_compute_engine_vm_takes_its_projects_os_login_unless_its_own_metadata_says(pod, emulator):
    kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=emulator.endpoint)}
    instances = compute_v1.InstancesClient(**kw)
    instances._transport._extended_operations_services["zone_operations"] = compute_v1.ZoneOperationsClient(**kw)
    zone, vm = "us-east5-b", "org-vm"
    meta = {"enable-guest-attributes": "TRUE", "ssh-keys": f"tpurun:{pod.meta_key.public}"}
    inst = compute_v1.Instance(
        name=vm,
        machine_type=f"zones/{zone}/machineTypes/ct6e-standard-1t",
        scheduling={"on_host_maintenance": "TERMINATE"},
        metadata={"items": [{"key": k, "value": v} for k, v in meta.items()]},
        # an external address: logged in to from this machine (a VM without one takes its network and IAP only)
        network_interfaces=[{"network": "global/networks/default", "access_configs": [{"name": "External NAT"}]}],
    )
    instances.insert(project=PROJECT, zone=zone, instance_resource=inst).result(timeout=60)
    try:
        address = instances.get(project=PROJECT, zone=zone, instance=vm).network_interfaces[0].network_i_p
        where = {"project": PROJECT, "zone": zone, "instance": vm}
        attrs = instances.get_guest_attributes(request={**where, "query_path": "hostkeys/"})
        worker = (address, host_key(attrs.query_value.items[0].value))
        key = Key()
        pod.import_key(ALICE, key)
        assert pod.login("alice_example_com", key, worker=worker) == "alice_example_com\n0\n"
        assert pod.login("tpurun", pod.meta_key, worker=worker) is None
        fingerprint = instances.get(project=PROJECT, zone=zone, instance=vm).metadata.fingerprint
        items = [{"key": k, "value": v} for k, v in {**meta, "enable-oslogin": "FALSE"}.items()]
        instances.set_metadata(
            project=PROJECT, zone=zone, instance=vm, metadata_resource={"fingerprint": fingerprint, "items": items}
        ).result(timeout=30)
        assert until(lambda: pod.login("tpurun", pod.meta_key, worker=worker), bool) == "tpurun\n0\n"
        assert pod.login("alice_example_com", key, worker=worker) is None
    finally:
        instances.delete(project=PROJECT, zone=zone, instance=vm).result(timeout=60)
