"""Every Google account's OS Login profile, as the OS Login API keeps it and the VMs' metadata servers serve it.

A profile is an account's SSH public keys (by fingerprint, each with its expiry) and its POSIX accounts (one per
project it was given one in). The names are Google's: the profile's `name` is the account's unique numeric id, a
POSIX username is the email with every character but a letter or a digit as `_`, lowercased, at most 32
characters (`sa_` and the unique id for a service account), uid and gid one large number per account, home
`/home/USERNAME`. A key's fingerprint is the SHA-256 of its blob, in hex. Sources: docs/emulator.md.

Every email is an existing account: a profile nobody wrote to is its name alone. The store is the emulator's, kept
as long as it runs; `watch` tells the workers when a project's POSIX accounts or their roles change.

Roles: IAM's two OS Login roles reduced to a grant per account and project, `login` (roles/compute.osLogin: it may
log in) or `adminLogin` (roles/compute.osAdminLogin: it may log in and use sudo), as the metadata server's
`authorize?policy=` names them. Every account has `adminLogin` until an administrator says otherwise
(`set_role`; `tpurun emulator oslogin-role`): the emulator takes every caller for the owner of its projects, and
a project's owner holds both.

2-step verification: every human account has one method enrolled, an authenticator application's one-time
password (RFC 6238's TOTP: 6 digits, a new one every 30 s, its secret the emulator's own, made anew at each
start), which `security_code` gives (the admin route and `tpurun emulator security-code`, in place of the
user's phone). A worker's metadata server starts a session for it and checks the code as guest-oslogin asks it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tpurun.emulator.model import ApiError, invalid

PROFILE_LIMIT = 32 * 1024  # bytes of a login profile (its POSIX accounts and unexpired keys, as JSON)
USERNAME_MAX = 32
SERVICE_ACCOUNT_DOMAIN = ".gserviceaccount.com"
KEY_TYPES = frozenset(
    {
        "ssh-rsa",
        "ssh-dss",
        "ssh-ed25519",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ecdsa-sha2-nistp256@openssh.com",
        "sk-ssh-ed25519@openssh.com",
    }
)
# what the API answers a key it cannot read, and the entity it does not have (Google's generic wordings)
_BAD_ARGUMENT = "Request contains an invalid argument."
_NOT_FOUND = "Requested entity was not found."
_TOO_BIG = "Login profile size exceeds 32 KiB. Delete profile values to make additional space."
CODE_STEP, CODE_DIGITS = 30, 6  # a one-time password's life in seconds, and its digits (TOTP's usual ones)
TOTP = "TOTP"  # the one challenge type an emulated account has enrolled
LOGIN, ADMIN_LOGIN = "login", "adminLogin"  # an account's grant in a project, as `authorize?policy=` names it


def not_found() -> ApiError:
    return ApiError(404, _NOT_FOUND, "NOT_FOUND")


def _digits(text: str, n: int) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % (10**n)


def unique_id(email: str) -> str:
    """The account's unique numeric id (21 digits, as Google's are): its profile's `name`."""
    return "1" + str(_digits("account:" + email.lower(), 20)).zfill(20)


def posix_username(email: str) -> str:
    """The POSIX username Google gives an account that has none set: `name@example.com` -> `name_example_com`,
    a service account `sa_` + its unique id."""
    email = email.lower()
    if email.endswith(SERVICE_ACCOUNT_DOMAIN):
        return "sa_" + unique_id(email)
    return re.sub(r"[^a-z0-9]", "_", email)[:USERNAME_MAX]


def posix_uid(email: str) -> int:
    """The account's uid (its gid too): one large number per account, below 2^31 as Google's are."""
    return 100_000_000 + _digits("uid:" + email.lower(), 12) % 2_000_000_000


def key_blob(text: str) -> tuple[str, bytes]:
    """An OpenSSH public key line (`TYPE BASE64 [comment]`) as its type and blob; a 400 when it is not one."""
    parts = text.split()
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise invalid(_BAD_ARGUMENT)
    try:
        blob = base64.b64decode(parts[1], validate=True)
        (size,) = struct.unpack(">I", blob[:4])
    except (binascii.Error, ValueError, struct.error) as e:
        raise invalid(_BAD_ARGUMENT) from e
    if blob[4 : 4 + size].decode("latin-1") != parts[0] or len(blob) <= 4 + size:
        raise invalid(_BAD_ARGUMENT)  # the blob names another type, or has nothing after its name
    return parts[0], blob


def fingerprint(text: str) -> str:
    """A key's fingerprint as the OS Login API computes it: the SHA-256 of its blob, in hex."""
    return hashlib.sha256(key_blob(text)[1]).hexdigest()


def now_usec() -> int:
    return int(time.time() * 1_000_000)


@dataclass
class _Key:
    text: str
    fingerprint: str
    expiry: int = 0  # microseconds since the epoch; 0: never

    def expired(self, now: int) -> bool:
        return 0 < self.expiry <= now


@dataclass
class _Profile:
    email: str
    keys: dict[str, _Key] = field(default_factory=dict)
    projects: set[str] = field(default_factory=set)  # those it has a POSIX account in


def account_json(email: str, project: str) -> dict[str, Any]:
    """The POSIX account Google generates for EMAIL in PROJECT (no shell: Google sets none on generated accounts,
    and the guest then gives /bin/bash)."""
    user, uid = posix_username(email), str(posix_uid(email))
    return {
        "primary": True,
        "username": user,
        "uid": uid,
        "gid": uid,
        "homeDirectory": f"/home/{user}",
        "accountId": project,
        "operatingSystemType": "LINUX",
        "name": f"users/{email}/projects/{project}",
    }


def key_json(email: str, key: _Key) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key.text}
    if key.expiry:
        out["expirationTimeUsec"] = str(key.expiry)
    out["fingerprint"] = key.fingerprint
    out["name"] = f"users/{email}/sshPublicKeys/{key.fingerprint}"
    return out


def _profile_json(p: _Profile, projects: Iterable[str], keys: Iterable[_Key]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": unique_id(p.email)}
    accounts = [account_json(p.email, proj) for proj in sorted(projects)]
    if accounts:
        out["posixAccounts"] = accounts
    listed = {k.fingerprint: key_json(p.email, k) for k in keys}
    if listed:
        out["sshPublicKeys"] = listed
    return out


def _size(p: _Profile) -> int:
    """A profile's size against the 32 KiB limit: its POSIX accounts and unexpired keys as JSON (expired keys are
    not counted: a key's expiry is the cure Google's users apply to a full profile)."""
    now = now_usec()
    live = [k for k in p.keys.values() if not k.expired(now)]
    return len(json.dumps(_profile_json(p, p.projects, live), separators=(",", ":")))


class OsLoginStore:
    """Every account's profile (thread-safe). Methods raise ApiError as the OS Login API answers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._profiles: dict[str, _Profile] = {}
        self._watchers: list[Callable[[str], None]] = []
        self._code_key = secrets.token_bytes(32)  # every account's TOTP secret derives from it
        self._sessions: dict[str, str] = {}  # a 2FA session's id -> its account's email
        self._roles: dict[tuple[str, str], str] = {}  # (email, project) -> LOGIN where not ADMIN_LOGIN

    def watch(self, fn: Callable[[str], None]) -> None:
        """Call FN(project) after the POSIX accounts of a project changed (outside the store's lock)."""
        self._watchers.append(fn)

    def _changed(self, projects: Iterable[str]) -> None:
        for project in projects:
            for fn in list(self._watchers):
                fn(project)

    def _profile(self, email: str) -> _Profile:
        if "@" not in email:
            raise not_found()
        return self._profiles.setdefault(email.lower(), _Profile(email.lower()))

    # ------------------------------------------------------------------ the API's methods

    def login_profile(self, email: str, project: str = "", system_id: str = "") -> dict[str, Any]:
        """users.getLoginProfile: the profile, its POSIX accounts those of PROJECT when given (generated accounts
        have the default, empty system id: another SYSTEM_ID has none)."""
        with self._lock:
            p = self._profile(email)
            projects = [] if system_id else [x for x in p.projects if not project or x == project]
            return _profile_json(p, projects, p.keys.values())

    def import_key(self, email: str, text: str, expiry: int, project: str = "") -> dict[str, Any]:
        """users.importSshPublicKey: the key joins the profile (a key already there is replaced, its expiry too),
        and the account gets a POSIX account in PROJECT if it has none; refused, and nothing changed, when the
        profile would pass 32 KiB."""
        text = text.strip()
        fp = fingerprint(text)
        with self._lock:
            p = self._profile(email)
            before = (dict(p.keys), set(p.projects))
            p.keys[fp] = _Key(text, fp, max(expiry, 0))
            new = bool(project) and project not in p.projects
            if project:
                p.projects.add(project)
            if _size(p) > PROFILE_LIMIT:
                p.keys, p.projects = before
                raise invalid(_TOO_BIG)
            out = {
                "loginProfile": _profile_json(
                    p, [x for x in p.projects if not project or x == project], p.keys.values()
                )
            }
        if new:
            self._changed([project])
        return out

    def get_key(self, email: str, fp: str) -> dict[str, Any]:
        with self._lock:
            p = self._profile(email)
            if fp not in p.keys:
                raise not_found()
            return key_json(p.email, p.keys[fp])

    def update_key(self, email: str, fp: str, text: str, expiry: int, mask: list[str]) -> dict[str, Any]:
        """users.sshPublicKeys.patch: the fields MASK names (`key`, `expirationTimeUsec`; every field without a
        mask) from the given ones; a key text must be the same key (its fingerprint is its name)."""
        fields = {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), f) for f in mask} or {"key", "expirationTimeUsec"}
        if not fields <= {"key", "expirationTimeUsec"}:
            raise invalid(_BAD_ARGUMENT)
        with self._lock:
            p = self._profile(email)
            if fp not in p.keys:
                raise not_found()
            key = p.keys[fp]
            if "key" in fields and text.strip():
                if fingerprint(text.strip()) != fp:
                    raise invalid(_BAD_ARGUMENT)
                key.text = text.strip()
            if "expirationTimeUsec" in fields:
                key.expiry = max(expiry, 0)
            return key_json(p.email, key)

    def delete_key(self, email: str, fp: str) -> None:
        with self._lock:
            p = self._profile(email)
            if p.keys.pop(fp, None) is None:
                raise not_found()

    def delete_posix_account(self, email: str, project: str) -> None:
        """users.projects.delete: the account's POSIX account in PROJECT goes (its keys stay)."""
        with self._lock:
            p = self._profile(email)
            if project not in p.projects:
                raise not_found()
            p.projects.discard(project)
        self._changed([project])

    # ------------------------------------------------------------------ what a VM of a project sees

    def _members(self, project: str) -> list[_Profile]:
        with self._lock:
            return [p for _, p in sorted(self._profiles.items()) if project in p.projects]

    def set_role(self, email: str, project: str, role: str) -> None:
        """Give EMAIL the grant ROLE (LOGIN or ADMIN_LOGIN) in PROJECT, as an administrator's IAM binding does."""
        if role not in (LOGIN, ADMIN_LOGIN) or "@" not in email or not project:
            raise invalid(_BAD_ARGUMENT)
        with self._lock:
            if role == ADMIN_LOGIN:
                self._roles.pop((email.lower(), project), None)
            else:
                self._roles[(email.lower(), project)] = role
        self._changed([project])

    def role(self, email: str, project: str) -> str:
        with self._lock:
            return self._roles.get((email.lower(), project), ADMIN_LOGIN)

    def accounts(self, project: str) -> list[tuple[str, int, bool]]:
        """PROJECT's POSIX accounts (what a VM's NSS module lists): each one's username, uid (its gid too), and
        whether it may use sudo (ADMIN_LOGIN)."""
        return [
            (posix_username(p.email), posix_uid(p.email), self.role(p.email, project) == ADMIN_LOGIN)
            for p in self._members(project)
        ]

    def security_code(self, email: str, at: float | None = None) -> str:
        """EMAIL's one-time password at AT (now): what its authenticator application shows."""
        return self._code(email, int((time.time() if at is None else at) // CODE_STEP))

    def _code(self, email: str, step: int) -> str:
        secret = hmac.new(self._code_key, email.lower().encode(), hashlib.sha256).digest()[:20]
        digest = hmac.new(secret, struct.pack(">Q", step), hashlib.sha1).digest()
        offset = digest[-1] & 0x0F
        value = struct.unpack(">I", digest[offset : offset + 4])[0] & 0x7FFFFFFF
        return f"{value % 10**CODE_DIGITS:0{CODE_DIGITS}d}"

    def _code_ok(self, email: str, code: str) -> bool:
        """Whether CODE is EMAIL's one-time password now, or one step before or after (a clock's drift, a code typed
        as it changed), as authenticator codes are usually checked."""
        step = int(time.time() // CODE_STEP)
        return any(hmac.compare_digest(self._code(email, step + d), code.strip()) for d in (-1, 0, 1))

    def _second_step(self, members: list[_Profile], path: list[str], body: dict[str, Any]) -> tuple[int, Any]:
        """`authenticate/sessions/start` and `authenticate/sessions/ID/continue` (POST), as pam_oslogin_login
        speaks them: a session offers each account's one enrolled challenge (TOTP, when the guest supports it),
        and a RESPOND with its code authenticates it; a session ends at its first answer."""
        who = str(body.get("email", "")).lower()
        hit = [p for p in members if who in (p.email, unique_id(p.email))]
        if not hit:
            return 400, "Bad Request\n"
        email = hit[0].email
        if path == ["start"]:
            if TOTP not in body.get("supportedChallengeTypes", []):
                return 200, {"status": "NO_AVAILABLE_CHALLENGES"}
            sid = secrets.token_urlsafe(24)
            with self._lock:
                while len(self._sessions) >= 10_000:  # sessions nobody answered
                    self._sessions.pop(next(iter(self._sessions)))
                self._sessions[sid] = email
            challenge = {"challengeId": 1, "challengeType": TOTP, "status": "READY"}
            return 200, {"status": "CHALLENGE_REQUIRED", "sessionId": sid, "challenges": [challenge]}
        if len(path) == 2 and path[1] == "continue":
            with self._lock:
                owner = self._sessions.pop(path[0], None)
            if owner != email or body.get("challengeId") != 1 or body.get("action") != "RESPOND":
                return 400, "Bad Request\n"
            code = str((body.get("proposalResponse") or {}).get("credential", ""))
            return 200, {"status": "AUTHENTICATED" if self._code_ok(email, code) else "CHALLENGE_FAILED"}
        return 404, "Not Found\n"

    def metadata_answer(
        self, project: str, path: list[str], query: dict[str, str], body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """What the metadata server of a VM of PROJECT answers under `oslogin/` (OS Login on), as guest-oslogin
        reads it: `users?username=` / `?uid=` (404 for nobody), `users?pagesize=&pagetoken=` (pages end with a
        token of "0" and no profiles), `authorize?email=&policy=login|adminLogin` (`success`: an account with
        a POSIX account here may log in, and administer where its grant is ADMIN_LOGIN). EMAIL may be the account's email or its profile name. BODY: a
        POST's, under `authenticate/sessions/` (2FA, `_second_step`)."""
        members = self._members(project)
        if path[:2] == ["authenticate", "sessions"] and body is not None:
            return self._second_step(members, path[2:], body)

        def profile(p: _Profile) -> dict[str, Any]:
            with self._lock:
                return _profile_json(p, [project], p.keys.values())

        if path == ["users"] and ("username" in query or "uid" in query):
            hit = [
                p
                for p in members
                if query.get("username") in (None, posix_username(p.email))
                and query.get("uid") in (None, str(posix_uid(p.email)))
            ]
            return (200, {"loginProfiles": [profile(hit[0])]}) if hit else (404, "Not Found\n")
        if path == ["users"]:
            try:
                size, start = max(int(query.get("pagesize", "0")), 1), int(query.get("pagetoken") or "0")
            except ValueError:
                return 400, "Bad Request\n"
            chunk = members[start : start + size]
            if not chunk:
                return 200, {"nextPageToken": "0"}
            return 200, {"loginProfiles": [profile(p) for p in chunk], "nextPageToken": str(start + len(chunk))}
        if path == ["authorize"] and query.get("policy") in (LOGIN, ADMIN_LOGIN):
            who = query.get("email", "").lower()
            hit = [p for p in members if who in (p.email, unique_id(p.email))]
            admin = query["policy"] == LOGIN or any(self.role(p.email, project) == ADMIN_LOGIN for p in hit)
            return 200, {"success": bool(hit) and admin}
        return 404, "Not Found\n"
