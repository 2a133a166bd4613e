"""Long-running operations and the catalogue (accelerator types, runtime versions, locations)."""

from __future__ import annotations

from typing import Any

from tpurun.emulator.core import Core
from tpurun.emulator.model import RUNTIME_VERSIONS, ZONES, not_found, paged, split_name, split_parent
from tpurun.topology import all_accelerator_types, parse_accelerator_type


class Operations(Core):
    # ------------------------------------------------------------------ operations

    def get_operation(self, name: str) -> dict[str, Any]:
        with self.lock:
            op = self.ops.get(name)
            if op is None:
                raise not_found(name)
            return op.to_json()

    def list_operations(self, name: str, page_size: int, page_token: str) -> dict[str, Any]:
        project, zone = split_parent(name)
        with self.lock:
            ops = [
                o.to_json()
                for n, o in sorted(self.ops.items())
                if n.startswith(f"projects/{project}/locations/{zone}/")
            ]
        return paged("operations", ops, page_size, page_token, omit_empty=True)

    def delete_operation(self, name: str) -> None:
        with self.lock:
            if self.ops.pop(name, None) is None:
                raise not_found(name)

    def cancel_operation(self, name: str) -> None:
        # like most Google services: the request is recorded, the work carries on
        with self.lock:
            op = self.ops.get(name)
            if op is None:
                raise not_found(name)
            op.cancel_requested = True

    # ------------------------------------------------------------------ catalogue

    def list_accelerator_types(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        split_parent(parent)
        items = [self._accel_json(parent, t) for t in all_accelerator_types("tpu-api")]
        return paged("acceleratorTypes", items, page_size, page_token)

    def get_accelerator_type(self, name: str) -> dict[str, Any]:
        project, zone, t = split_name(name, "acceleratorTypes")
        if t not in all_accelerator_types("tpu-api"):
            raise not_found(name)
        return self._accel_json(f"projects/{project}/locations/{zone}", t)

    @staticmethod
    def _accel_json(parent: str, t: str) -> dict[str, Any]:
        topo = parse_accelerator_type(t)
        return {
            "name": f"{parent}/acceleratorTypes/{t}",
            "type": t,
            "acceleratorConfigs": [{"type": topo.api_type, "topology": topo.topology}],
        }

    def list_runtime_versions(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        split_parent(parent)
        items = [{"name": f"{parent}/runtimeVersions/{v}", "version": v} for v in RUNTIME_VERSIONS]
        return paged("runtimeVersions", items, page_size, page_token)

    def get_runtime_version(self, name: str) -> dict[str, Any]:
        _, _, v = split_name(name, "runtimeVersions")
        if v not in RUNTIME_VERSIONS:
            raise not_found(name)
        return {"name": name, "version": v}

    def list_locations(self, project_name: str, page_size: int, page_token: str) -> dict[str, Any]:
        items = [{"name": f"{project_name}/locations/{z}", "locationId": z} for z in ZONES]
        return paged("locations", items, page_size, page_token)

    def get_location(self, name: str) -> dict[str, Any]:
        zone = name.rsplit("/", 1)[-1]
        if zone not in ZONES:
            raise not_found(name)
        return {"name": name, "locationId": zone}
