"""How tpurun reaches workers: one interface (runner.py: a worker, and running a program there to completion,
as a stream or as a pipe) and its transports, SSH (ssh.py) and this machine (local.py); work on every
worker at once (fanout.py); and the target a command acts on, i.e. its workers resolved from settings
(targets.py)."""
