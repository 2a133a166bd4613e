"""How tpurun reaches one worker: one interface (runner.py: a worker, connecting to it, and running a program
there to completion, as a stream or as a pipe) and its transports, SSH (ssh.py) and this machine (local.py).
Every selected worker at once is `tpurun.fleet`'s, above this package."""
