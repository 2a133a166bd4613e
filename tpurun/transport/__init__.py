"""How tpurun reaches workers: runners, SSH or this machine, with one interface (runner.py); the programs
they start with their pipes connected to us (streams.py); work on every worker at once (fanout.py); and the
target a command acts on, i.e. its workers resolved from settings (targets.py)."""
