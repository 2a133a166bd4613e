"""A training job: the plan, i.e. the env contract of every process (plan.py, pure functions), the
script's dependencies on every worker (setup.py), and the launcher that starts the agents, streams their
records and decides the outcome (launcher.py)."""
