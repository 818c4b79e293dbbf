"""Tessera's decisions, in one room: pure objects with no I/O of their own beyond reading a JSON file,
no torch, no role imports (pyproject.toml's layers contract). The roles wrap them; the simulator runs them.

- `perf_model`, `batch_summary`: a worker kind's predicted prefill and decode-step time, the batches it
  prices, and the `perf_models/<kind>.json` files a worker's profile writes and the gateway reads by name;
- `eviction`, `adapter_tiers`: which adapter leaves a full tier first, one worker's GPU / host / disk tiers
  and their load costs;
- `load_failures`: adapter loads that failed lately, with their backoff;
- `placement`: the registry's plan of which adapters each worker holds (ROCK);
- `routing/`: the gateway's worker state table and routing policies (CaraServe's rank- and SLO-aware);
- `cold_start`, `mode_policies`, `mode_costs`: how a worker starts a cold request and which inference
  mode (merged, mixture, unmerged) each step runs (VaLoRA);
- `simulator/`: a discrete-event simulation of a cluster that runs all of the above
  (`python -m policy.simulator`).
"""
