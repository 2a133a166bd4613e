"""OS Login: a TPU's policy read from the API (login_policy.py decides it as the guest does), and tpurun's key
in the login profile of the account it acts as. An organisation that requires OS Login
(`compute.requireOsLogin`) does it by writing `enable-oslogin=TRUE` into its projects' metadata.

How: a worker with OS Login on ignores every `ssh-keys` entry; its sshd asks the metadata server for the
keys of the login profile of the user logging in, who must be that profile's POSIX account in the project
(`name_example_com` for name@example.com, `sa_<id>` for a service account). So tpurun imports its own key
(one per tpurun home, the one it uses everywhere) into the profile of the account it acts as
(`acting_account`) through the OS Login API, with an expiry: `KEY_HOURS` from the import, renewed when less
than `RENEW_SECONDS` is left before a connection needs it (`Login.user`). It never imports a key without
an expiry, so nothing piles up in the profile (a profile is refused past 32 KiB). What the API said is kept in
`$TPURUN_HOME/oslogin/` (the POSIX user name and the key's expiry), so a command on a TPU tpurun knows makes
no API call while the key has time left.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurun import ui
from tpurun.cloud.login_policy import CERTIFICATES, ENABLE, TWO_FACTOR, Policy
from tpurun.errors import ApiError, UsageError

if TYPE_CHECKING:
    from tpurun.cloud.client import Cloud
    from tpurun.settings import Setting, Settings

KEY_HOURS = 1.0  # an imported key's life
RENEW_SECONDS = 900.0  # a key with less than this left is renewed before a connection needs it
SERVICE_ACCOUNT_DOMAIN = ".gserviceaccount.com"
ROLE_HINT = "logging in takes the Compute OS Login role (roles/compute.osLogin) in the TPU's project"
ADMIN_ROLE = "roles/compute.osAdminLogin"  # Compute OS Admin Login: OS Login's sudo on the VMs


def policy_of(cloud: Cloud, own: Mapping[str, str]) -> Policy:
    """The policy of a TPU whose own metadata is OWN, in CLOUD's project: its project's metadata read only where
    OWN does not decide (a project that cannot be read, for want of a role, counts as saying nothing)."""
    if ENABLE in own:
        return Policy.of(own, {})
    try:
        project = project_metadata(cloud)
    except ApiError:
        project = {}
    return Policy.of(own, project)


def project_metadata(cloud: Cloud) -> dict[str, str]:
    """The project's common metadata (Compute Engine's `projects.get`, by plain REST: see `Cloud.compute_get`)."""
    project = cloud.compute_get("") or {}  # (a project Compute Engine does not know has none)
    items = project.get("commonInstanceMetadata", {}).get("items", [])
    return {item["key"]: item.get("value", "") for item in items}


def acting_account(s: Settings, credentials: Any = None) -> tuple[str, str]:
    """(the Google account tpurun acts as, where that came from): the `account` setting (TPURUN_ACCOUNT, a
    file, gcloud's active configuration), else what the credentials say of themselves (a service account's
    email, the account a user's credentials were made for); ("", why not) when nothing says."""
    if s.account.value:
        return s.account.value, s.account.source
    if credentials is None:
        return "", "not set"
    for attribute in ("service_account_email", "account"):  # a service account's; a user's (gcloud writes it)
        email = getattr(credentials, attribute, None)
        if isinstance(email, str) and "@" in email:
            return email, "the credentials"
    return "", "not set (the credentials do not name an account)"


def account_setting(s: Settings, env: Mapping[str, str]) -> Setting:
    """The `account` setting as `config show` tells it: the setting, else what the application-default
    credentials' file says (read here without the network: on a Google VM without one, its service account)."""
    from tpurun.cloud.services import is_emulator
    from tpurun.settings import Layer, Setting

    if s.account.value:
        return s.account
    if is_emulator(s.endpoint):
        return Setting("account", None, "not set (the emulator's credentials are anonymous)", Layer.UNSET)
    path = env.get("GOOGLE_APPLICATION_CREDENTIALS") or str(_gcloud_adc(env))
    try:
        import google.auth

        creds, _ = google.auth.load_credentials_from_file(path)
    except Exception:  # noqa: BLE001 - absent or unreadable: not an error of `config show`
        return Setting(
            "account", None, "not set (no credentials file: on a Google VM, its service account)", Layer.UNSET
        )
    account, _ = acting_account(s, creds)
    return Setting("account", account or None, path, Layer.FILE if account else Layer.UNSET)


def _gcloud_adc(env: Mapping[str, str]) -> Path:
    """Where `gcloud auth application-default login` writes the user's credentials."""
    from tpurun.settings import xdg_config_home

    root = Path(env["CLOUDSDK_CONFIG"]) if env.get("CLOUDSDK_CONFIG") else xdg_config_home(env) / "gcloud"
    return root / "application_default_credentials.json"


def account_for(s: Settings, tpu: str) -> str:
    """The account tpurun logs in to the OS Login TPU named TPU as (`acting_account`); refused in one line where
    nothing says it."""
    creds = None
    if not s.account.value:
        from tpurun.cloud.services import credentials

        creds = credentials(s.endpoint)
    account, why = acting_account(s, creds)
    if not account:
        raise UsageError(
            f"{tpu} takes logins through OS Login, which needs the Google account tpurun acts as: {why}",
            hint="set TPURUN_ACCOUNT=you@example.com (or `account` in tpurun.toml)",
        )
    return account


def is_service_account(account: str) -> bool:
    return account.endswith(SERVICE_ACCOUNT_DOMAIN)


class Login:
    """tpurun's key in ACCOUNT's login profile for the TPU's project, and the POSIX user it logs in as there.
    Safe to call from every connecting thread: at most one asks the API at a time."""

    def __init__(self, s: Settings, tpu: str, policy: Policy) -> None:
        from tpurun.cloud import keys

        self.s, self.tpu, self.policy = s, tpu, policy
        self.project = s.project.value or ""
        self.public = keys.ensure_key(s.home_path)[1]
        self.lock = threading.Lock()
        self._account = ""
        self._memo: dict[str, Any] | None = None  # what the record says, read once: every connection asks
        self._cloud: Cloud | None = None

    def _client(self) -> tuple[Cloud, Any]:
        from google.cloud import oslogin_v1

        from tpurun.cloud.client import Cloud
        from tpurun.cloud.services import OSLOGIN_API, endpoint_of

        if self._cloud is None:
            self._cloud = Cloud(self.s)
        options = {"api_endpoint": endpoint_of(OSLOGIN_API, self._cloud.endpoint)}
        client = oslogin_v1.OsLoginServiceClient(
            transport="rest", client_options=options, credentials=self._cloud.credentials
        )
        return self._cloud, client

    def account(self) -> str:
        if not self._account:
            self._account = account_for(self.s, self.tpu)
        return self._account

    def check(self) -> None:
        """Refuse what tpurun cannot do, in one line, before any connection tries."""
        if self.policy.certificates:
            raise UsageError(
                f"{self.tpu} takes OS Login certificates only (metadata {CERTIFICATES}), which tpurun does not "
                "use yet: it logs in with a key imported into the login profile",
                hint=f"a TPU whose metadata has {CERTIFICATES}=FALSE, or gcloud's ssh",
            )
        if self.asks_person() and not ui.can_ask():
            raise UsageError(
                f"{self.tpu} asks for OS Login 2-step verification (metadata {TWO_FACTOR}) at every login, and "
                f"there is no terminal to ask you ({self.account()}) for the code on",
                hint="run the command on a terminal, or act as a service account (they are not asked): "
                "TPURUN_ACCOUNT and its key in GOOGLE_APPLICATION_CREDENTIALS",
            )

    def asks_person(self) -> bool:
        """Whether every worker asks the person tpurun acts for a second factor at login: 2-step verification, for
        anyone but a service account."""
        return self.policy.two_factor and not is_service_account(self.account())

    def user(self) -> str:
        """The POSIX user to log in as, the key renewed first where it has less than RENEW_SECONDS left."""
        with self.lock:
            self.check()
            held = self._memo or self._held()
            if held is None or held["expires"] - time.time() <= RENEW_SECONDS:
                username, expires = self._import()
                held = {"username": username, "expires": expires, "key": _blob(self.public)}
                self._keep(held)
            self._memo = held
            return str(held["username"])

    def _path(self) -> Path:
        return self.s.home_path / "oslogin" / f"{self.account()}--{self.project}.json"

    def _held(self) -> dict[str, Any] | None:
        try:
            held = json.loads(self._path().read_text())
        except (OSError, ValueError):
            return None
        return held if isinstance(held, dict) and held.get("key") == _blob(self.public) else None

    def _keep(self, held: dict[str, Any]) -> None:
        path = self._path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two commands at once each write their own
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # as tpurun's other records
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(held))
        tmp.replace(path)

    def _import(self) -> tuple[str, float]:
        """tpurun's key into the profile (its expiry renewed where it is there), and (the POSIX user, the expiry)."""
        from tpurun.cloud.services import OSLOGIN_API

        cloud, client = self._client()
        user = f"users/{self.account()}"
        expires = time.time() + KEY_HOURS * 3600
        key = {"key": self.public, "expiration_time_usec": int(expires * 1e6)}
        profile = cloud.call(
            f"import tpurun's key into the OS Login profile of {self.account()}",
            lambda: client.import_ssh_public_key(parent=user, ssh_public_key=key, project_id=self.project),
            api=OSLOGIN_API,
        ).login_profile
        mine = [fp for fp, k in profile.ssh_public_keys.items() if _blob(k.key) == _blob(self.public)]
        stale = [fp for fp in mine if profile.ssh_public_keys[fp].expiration_time_usec < key["expiration_time_usec"]]
        for fp in stale:  # imported again with another expiry: the API keeps one entry per key, renewed

            def renew(name: str = f"{user}/sshPublicKeys/{fp}") -> Any:
                return client.update_ssh_public_key(
                    name=name, ssh_public_key=key, update_mask={"paths": ["expiration_time_usec"]}
                )

            cloud.call("renew tpurun's key in the OS Login profile", renew, api=OSLOGIN_API)
        return _posix_user(profile, self.project, self.account()), expires


def _posix_user(profile: Any, project: str, account: str) -> str:
    """The profile's POSIX account in PROJECT, as gcloud picks it: the primary one, else the first."""
    accounts = [a for a in profile.posix_accounts if not a.account_id or a.account_id == project]
    chosen = next((a for a in accounts if a.primary), accounts[0] if accounts else None)
    if chosen is None or not chosen.username:
        raise ApiError(
            f"the OS Login profile of {account} has no POSIX account in project {project}",
            hint=ROLE_HINT,
        )
    return str(chosen.username)


def _blob(line: str) -> str:
    """A public key line's type and key (its comment aside): what identifies it."""
    return " ".join(line.split()[:2])
