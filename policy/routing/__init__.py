"""The gateway's routing decisions: no I/O, no clock of their own.

- `worker_state`: the latest state each worker pushed, plus the gateway's own unreported dispatches.
- `policies`: the `Policy` interface and the baselines; `tessera_policy`: the rank-, SLO- and
  cache-aware policy.

They price batches with the performance model and the adapter tiers of the room above (policy/).
The live gateway (gateway/router.py) and the cluster simulator (policy/simulator/) run these very objects.
"""
