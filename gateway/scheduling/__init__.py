"""The gateway's scheduling core: pure objects, no I/O, no clock of their own.

- `worker_state`: the latest state each worker pushed, plus the gateway's own unreported dispatches.
- `policies`: the `Policy` interface and the baselines; `tessera_policy`: the rank-, SLO- and
  cache-aware policy.

They price batches with the shared performance model and adapter tiers (services/common/scheduling).
The cluster simulator (benchmarks/simulate_cluster.py) runs these very objects.
"""
