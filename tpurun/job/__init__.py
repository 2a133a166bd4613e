"""A training job: the env contract of every process (env_contract.py, with each runtime's variables in
runtimes.py; pure functions), the script's dependencies on every worker (setup.py), the launcher that starts
the agents, streams their records and decides the outcome (launcher.py), and what follows a start: status.py
(`jobs`) and control.py (`logs`, `cancel`)."""
