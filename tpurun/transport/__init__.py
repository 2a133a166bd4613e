"""How tpurun reaches workers: one interface (runner.py: a worker, connecting to it, and running a program there
to completion, as a stream or as a pipe) and its transports, SSH (ssh.py) and this machine (local.py); every
worker at once through a Fleet (fleet.py: its operations; threads.py: the first implementation); and the target
a command acts on, i.e. its workers resolved from settings (targets.py)."""
