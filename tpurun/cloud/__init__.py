"""The cloud layer: the Cloud TPU API client (client.py), provisioning (provision.py), the startup
scripts tpurun wraps (startup.py) and the ssh key and pinned host keys (keys.py)."""
