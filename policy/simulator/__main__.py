"""`python -m policy.simulator`: the cluster simulator's command line (cli.py)."""

from policy.simulator.cli import main

main()
