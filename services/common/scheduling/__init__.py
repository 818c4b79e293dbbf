"""What the gateway's scheduler and the worker share, pure objects with no I/O of their own:

- `batch_summary`: a batch as the performance model sees it (entries and their running sums);
- `perf_model`: per worker kind, predicted prefill and decode-step time, its fit, and the
  `perf_models/<kind>.json` files a worker's profile writes and the gateway reads by name;
- `eviction`: which adapter leaves a full tier first (frequency with decay, LRU);
- `adapter_tiers`: one worker's GPU / host / disk adapter tiers and their load costs.
"""
