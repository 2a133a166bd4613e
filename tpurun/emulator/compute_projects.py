"""Compute Engine projects: `projects.get` and `projects.setCommonInstanceMetadata`, as google-cloud-compute's
ProjectsClient drives them; the metadata itself is the organisation's (org.py), which every worker of the project
reads. A project is any project a caller names, numbered as its VMs' metadata servers number it.
"""

from __future__ import annotations

from typing import Any

from google.cloud import compute_v1

from tpurun.emulator.compute_model import compute_error, link
from tpurun.emulator.maintenance import HostEvents
from tpurun.emulator.org import StaleFingerprint

# when every emulated project was made (its creationTimestamp: the field is always there on the real API)
_CREATED = "2024-01-01T00:00:00.000-08:00"


class Projects(HostEvents):
    def _project_json(self, project: str) -> dict[str, Any]:
        items, fingerprint = self.org.projects.get(project)
        metadata: dict[str, Any] = {"kind": "compute#metadata", "fingerprint": fingerprint}
        if items:
            metadata["items"] = [{"key": k, "value": v} for k, v in items.items()]
        number = self.project_number(project)
        return {
            "kind": "compute#project",
            "id": number,
            "creationTimestamp": _CREATED,
            "name": project,
            "commonInstanceMetadata": metadata,
            "selfLink": link(f"projects/{project}"),
            "defaultServiceAccount": f"{number}-compute@developer.gserviceaccount.com",
            "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
            "defaultNetworkTier": "PREMIUM",
            "vmDnsSetting": "ZONAL_ONLY",
        }

    def get_project(self, project: str) -> dict[str, Any]:
        return self._project_json(project)

    def set_common_instance_metadata(self, project: str, metadata: compute_v1.Metadata) -> dict[str, Any]:
        """Replace the project's common metadata, given its current fingerprint (a stale one is 412
        conditionNotMet, as for an instance); a global operation. Its workers take it after the propagation delay,
        as they take their own metadata."""
        items = {i.key: i.value for i in metadata.items}
        self._validate_metadata(items)
        try:
            self.org.projects.set(project, items, metadata.fingerprint)
        except StaleFingerprint as e:
            raise compute_error(
                412, "Supplied fingerprint does not match current metadata fingerprint.", "conditionNotMet"
            ) from e
        path = f"projects/{project}"
        op = self._operation(f"{path}/global", "setCommonInstanceMetadata", path, int(self.project_number(project)))
        return self._quick(op)
