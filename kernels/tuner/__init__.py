"""Offline tuning of the LoRA kernels' tiles: `python -m kernels.tuner` times candidate
configurations per shape bucket on this GPU and writes the table kernels/tiling.py looks up at run
time (kernels/tables/<gpu>.json). Nothing here runs while serving.

A bucket (tiling.Bucket) is one op on one fused projection of the model, a rank tile block_r, a
batch of T tokens and a largest group of G (`buckets`). It is timed on representative batches
(`batches`): T tokens in groups of spread sizes and of random sizes, their rows interleaved, each
group its own adapter slot targeting every slice, each batch in rotating copies whose bytes span
more than the L2 (`workload`, `timing`). The configuration kept is the one whose worst time over
those batches, relative to the best on each, is least (`search.regrets`). The full grid of
configurations is ~10x too large to time, so the search has two stages (`candidates`): tile shapes
at fixed warps/stages, then the SHORTLIST best shapes over warps x stages. The heuristic's choice is
always timed as well: an entry is never worse than no entry. `table_io` merges the entries into
the table on disk; `__main__` is the command line.
"""
