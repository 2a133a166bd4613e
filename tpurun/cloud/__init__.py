"""The cloud layer: the Cloud TPU API client (client.py), provisioning (provision.py), the startup
scripts tpurun wraps (startup.py), the ssh key and host keys pinned per TPU identity (keys.py), and what
tpurun remembers of each TPU between commands (identity.py)."""
