"""Shared fixtures: the Cloud TPU emulator (tpurun.emulator.pytest_plugin)."""

pytest_plugins = ["tpurun.emulator.pytest_plugin"]
