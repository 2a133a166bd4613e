"""How a TPU's workers let users in, as their guest software decides it (and gcloud too): a key
(`enable-oslogin`, and beside it `enable-oslogin-2fa`, `enable-oslogin-certificates`) in the node's or
instance's own metadata decides; where the TPU's metadata does not have the key, the project's common
metadata does. Its value "true", in any case, is on. What tpurun then does is oslogin.py's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENABLE, TWO_FACTOR, CERTIFICATES = "enable-oslogin", "enable-oslogin-2fa", "enable-oslogin-certificates"


@dataclass(frozen=True)
class Policy:
    """How a TPU's workers let users in: through OS Login or not, with 2-step verification, with certificates."""

    oslogin: bool = False
    two_factor: bool = False
    certificates: bool = False

    @classmethod
    def of(cls, own: Mapping[str, str], project: Mapping[str, str]) -> Policy:
        """As the guest decides it: the TPU's OWN metadata first, then the PROJECT's common metadata."""

        def on(key: str) -> bool:
            value = own[key] if key in own else project.get(key, "")
            return value.strip().lower() == "true"

        enabled = on(ENABLE)
        return cls(enabled, enabled and on(TWO_FACTOR), enabled and on(CERTIFICATES))

    def to_json(self) -> dict[str, bool]:
        return {"oslogin": self.oslogin, "twoFactor": self.two_factor, "certificates": self.certificates}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Policy:
        data = data or {}
        return cls(bool(data.get("oslogin")), bool(data.get("twoFactor")), bool(data.get("certificates")))
