"""Google's services tpurun speaks, where each answers beside the Cloud TPU API's endpoint (Google's own hosts,
or the emulator's one endpoint), and the credentials they are called with. Loads no API client: the IAP tunnel
of a command on remembered workers needs its endpoint and a token, not google-cloud-tpu."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from tpurun.errors import ApiError, UsageError


@dataclass(frozen=True)
class Service:
    """A Google API tpurun calls, as its messages name it."""

    title: str
    host: str  # its public endpoint, and the name `gcloud services enable` takes
    roles: str  # the IAM roles its calls need


TPU_API = Service("Cloud TPU API", "tpu.googleapis.com", "the Cloud TPU Admin role (roles/tpu.admin)")
COMPUTE_API = Service(
    "Compute Engine API",
    "compute.googleapis.com",
    "the Compute Instance Admin (v1) role (roles/compute.instanceAdmin.v1) and Service Account User "
    "(roles/iam.serviceAccountUser)",
)

OSLOGIN_API = Service(
    "Cloud OS Login API",
    "oslogin.googleapis.com",
    "the Compute OS Login role (roles/compute.osLogin), or Compute OS Admin Login (roles/compute.osAdminLogin)",
)

# the Billing Catalog (list prices): readable by any caller with credentials, no role needed
BILLING_API = Service("Cloud Billing API", "cloudbilling.googleapis.com", "no role: the catalogue is public")

# IAP's TCP forwarding: a WebSocket service (wss), not a REST API; its connect path is `TUNNEL_PATH` below the host
TUNNEL = Service(
    "IAP TCP forwarding",
    "tunnel.cloudproxy.app",
    "the IAP-secured Tunnel User role (roles/iap.tunnelResourceAccessor)",
)
TUNNEL_PATH = "/v4/connect"


def endpoint_of(api: Service, endpoint: str) -> str:
    """API's endpoint beside the Cloud TPU API's ENDPOINT: Google's own for Google's, else the same (the
    emulator answers every API tpurun speaks)."""
    host = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}").hostname or ""
    return f"https://{api.host}" if host.endswith(TPU_API.host) else endpoint


def compute_endpoint(endpoint: str) -> str:
    """Compute Engine's endpoint beside the Cloud TPU API's ENDPOINT."""
    return endpoint_of(COMPUTE_API, endpoint)


def tunnel_url(endpoint: str) -> str:
    """Where IAP's tunnels are opened beside the Cloud TPU API's ENDPOINT: wss://tunnel.cloudproxy.app/v4/connect
    for Google's, ws:// (wss:// for https) on the same host and port for another (the emulator's)."""
    url = urlparse(endpoint_of(TUNNEL, endpoint if "://" in endpoint else f"https://{endpoint}"))
    scheme = "ws" if url.scheme == "http" else "wss"
    return f"{scheme}://{url.netloc}{TUNNEL_PATH}"


def is_emulator(endpoint: str) -> bool:
    """An http:// endpoint on a loopback address is the local emulator (anonymous credentials)."""
    url = urlparse(endpoint)
    if url.scheme != "http" or not url.hostname:
        return False
    try:
        return ipaddress.ip_address(url.hostname).is_loopback
    except ValueError:
        return url.hostname == "localhost"


def credentials(endpoint: str) -> Any:
    """Anonymous for the emulator, else Application Default Credentials."""
    if is_emulator(endpoint):
        from google.auth.credentials import AnonymousCredentials

        return AnonymousCredentials()
    if endpoint.startswith("http://"):
        raise UsageError(
            f"refusing to send Google credentials over plain http to {endpoint}: "
            "use an https endpoint, or a loopback http endpoint for the emulator"
        )
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except DefaultCredentialsError:
        raise ApiError(
            "no Google credentials found",
            hint="run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS "
            "to a service-account key file",
        ) from None
    return creds
