"""tpurun: a job launcher for Cloud TPU VMs and pod slices."""

__version__ = "0.1.0"
