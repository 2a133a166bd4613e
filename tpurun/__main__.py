"""`python -m tpurun` runs the CLI."""

from tpurun.cli import main

main()
