"""The gateway's scheduling core: pure objects, no I/O, no clock of their own.

- `batch`: what a batch looks like to the performance model (entries and their running sums).
- `perf_model`: per worker kind, predicted prefill and decode-iteration time; fitted from profiles.
- `adapter_cache`: the GPU / host / disk adapter tiers of one worker and their eviction policy.
- `worker_state`: the latest state each worker pushed, plus the gateway's own unreported dispatches.
- `policies`: the `Policy` interface and the baselines; `tessera_policy`: the rank-, SLO- and
  cache-aware policy.

The cluster simulator (benchmarks/simulate_cluster.py) runs these very objects.
"""
