"""A discrete-event simulation of a Tessera cluster, running the gateway's own scheduling objects
(gateway/scheduling). Entry point: benchmarks/simulate_cluster.py."""
