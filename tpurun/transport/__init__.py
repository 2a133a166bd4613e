"""How tpurun reaches workers: runners (SSH and this machine) with one interface, the fan-out over
them (runner.py), and the target a command acts on: its workers, resolved from settings (targets.py)."""
