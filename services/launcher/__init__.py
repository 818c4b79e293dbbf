"""`tessera up`: run every role as a supervised child process on this machine.

`plan.py` decides what to start: one child per role (a worker per base model, or as launcher.workers
says), the ports each binds, its config overrides, and the checks made before anything starts.
`supervisor.py` runs that plan: it starts the children in order, restarts those that die, stops them
all, and keeps their state in `<run_path>/launcher.json`.
"""
