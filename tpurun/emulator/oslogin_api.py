"""The emulator's OS Login API v1 REST surface (oslogin.googleapis.com's), as google-cloud-os-login's REST transport
calls it (its `services/os_login_service/transports/rest_base.py`): a user's login profile, its SSH public keys
(import, get, patch, delete) and its POSIX account in a project (delete). `{user}` is the account's email, which
the client sends URL-encoded (`users/name%40example.com`). Bodies are parsed with the package's own messages; the
profiles are the organisation's (oslogin.py), which the workers of each project read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from google.cloud.oslogin_v1 import common

from tpurun.emulator.routing import Request, Router, parse_message

if TYPE_CHECKING:
    from tpurun.emulator.state import Emulator

_USER = "/v1/users/(?P<user>[^/:]+)"
_KEY = f"{_USER}/sshPublicKeys/(?P<fp>[^/:]+)"


def add_oslogin_routes(r: Router, emu: Emulator) -> None:
    def store() -> Any:
        return emu.org.oslogin  # looked up at each call: a reset gives the emulator a new organisation

    def key_body(q: Request) -> Any:
        return parse_message(common.SshPublicKey, q, "ssh_public_key")

    def import_key(q: Request) -> Any:
        key = key_body(q)
        return store().import_key(q.groups["user"], key.key, key.expiration_time_usec, q.q("projectId"))

    def update_key(q: Request) -> Any:
        key = key_body(q)
        mask = [p.strip() for p in q.q("updateMask").split(",") if p.strip()]
        return store().update_key(q.groups["user"], q.groups["fp"], key.key, key.expiration_time_usec, mask)

    def delete_key(q: Request) -> Any:
        store().delete_key(q.groups["user"], q.groups["fp"])
        return {}

    def delete_account(q: Request) -> Any:
        store().delete_posix_account(q.groups["user"], q.groups["project"])
        return {}

    r.add(
        "GET",
        f"{_USER}/loginProfile",
        lambda q: store().login_profile(q.groups["user"], q.q("projectId"), q.q("systemId")),
        ("projectId", "systemId"),
    )
    r.add("POST", f"{_USER}:importSshPublicKey", import_key, ("projectId", "regions"))
    r.add("GET", _KEY, lambda q: store().get_key(q.groups["user"], q.groups["fp"]))
    r.add("PATCH", _KEY, update_key, ("updateMask",))
    r.add("DELETE", _KEY, delete_key)
    r.add("DELETE", f"{_USER}/projects/(?P<project>[^/:]+)", delete_account)
