"""How tpurun reaches workers: one interface (runner.py: a worker, connecting to it, and running a program there
to completion, as a stream or as a pipe) and its transports, SSH (ssh.py) and this machine (local.py); every
worker at once through a Fleet (fleet.py: its operations; threads.py, one thread per worker of this machine;
relays.py, through relays inside the slice); and tpurun's programs on a worker, installed where missing
(bundle.py). The target a command acts on, its workers resolved from settings, is `tpurun.targets`."""
