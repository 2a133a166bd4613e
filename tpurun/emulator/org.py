"""The organisation the emulated projects belong to: each project's common instance metadata and every account's
OS Login profile, what the APIs change and every worker of a project reads (its metadata server, who may log in),
and who may open tunnels to its VMs through IAP (an administrator's switch).

A project exists as soon as it is named, with empty metadata, as every project a client names is taken to be one
the caller owns. Kept while the emulator runs, as the rest of its state.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tpurun.emulator.oslogin import OsLoginStore


def new_fingerprint() -> str:
    """A metadata fingerprint as Compute Engine writes them: 8 random bytes in base64."""
    return base64.b64encode(os.urandom(8)).decode()


class StaleFingerprint(Exception):
    """The caller's metadata fingerprint is not the current one (Compute Engine's 412 conditionNotMet)."""


class ProjectMetadata:
    """Each project's common instance metadata: its items and their fingerprint (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, dict[str, str]] = {}
        self._fingerprints: dict[str, str] = {}
        self._watchers: list[Callable[[str], None]] = []

    def watch(self, fn: Callable[[str], None]) -> None:
        """Call FN(project) after a project's metadata changed."""
        self._watchers.append(fn)

    def get(self, project: str) -> tuple[dict[str, str], str]:
        """PROJECT's items and their fingerprint."""
        with self._lock:
            fp = self._fingerprints.setdefault(project, new_fingerprint())
            return dict(self._items.get(project, {})), fp

    def attributes(self, project: str) -> dict[str, str]:
        return self.get(project)[0]

    def set(self, project: str, items: dict[str, str], fingerprint: str) -> str:
        """Replace PROJECT's items, when FINGERPRINT is the current one (else StaleFingerprint); the new one."""
        with self._lock:
            current = self._fingerprints.setdefault(project, new_fingerprint())
            if fingerprint != current:
                raise StaleFingerprint(project)
            self._items[project] = dict(items)
            self._fingerprints[project] = fp = new_fingerprint()
        for fn in list(self._watchers):
            fn(project)
        return fp


class TunnelAccess:
    """Who may tunnel to a project's VMs through IAP's TCP forwarding: IAM's "IAP-secured Tunnel User" role
    (permission iap.tunnelInstances.accessViaIAP) reduced to a switch, everywhere or per project; allowed unless an
    administrator denied it (`tpurun emulator iap deny`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._everywhere = True
        self._projects: dict[str, bool] = {}

    def set(self, allow: bool, project: str = "") -> None:
        """ALLOW tunnels to PROJECT's VMs; without a project, to every project's (each project's own say forgotten)."""
        with self._lock:
            if project:
                self._projects[project] = allow
            else:
                self._everywhere = allow
                self._projects.clear()

    def allows(self, project: str) -> bool:
        with self._lock:
            return self._projects.get(project, self._everywhere)

    def describe(self) -> dict[str, object]:
        """As the admin status shows it: {"everywhere": "allow", "projects": {"p": "deny"}}."""
        word = {True: "allow", False: "deny"}
        with self._lock:
            return {"everywhere": word[self._everywhere], "projects": {p: word[a] for p, a in self._projects.items()}}


@dataclass
class Organisation:
    """What every project shares: its metadata, the accounts that may log in to its VMs, who may tunnel to them."""

    projects: ProjectMetadata = field(default_factory=ProjectMetadata)
    oslogin: OsLoginStore = field(default_factory=OsLoginStore)
    iap: TunnelAccess = field(default_factory=TunnelAccess)
