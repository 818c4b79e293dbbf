"""A discrete-event simulation of a Tessera cluster, running the routing (policy/routing/) and
placement (policy/placement.py) decisions of the real roles. Entry point: `python -m policy.simulator`."""
