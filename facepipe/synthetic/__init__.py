"""Made-up inputs, never a stage's real data: the demo photo folder that ``facepipe sample-data`` writes
(:mod:`~facepipe.synthetic.photos`) and shard sets of noise for tests and throughput benchmarks
(:mod:`~facepipe.synthetic.shards`). Kept out of the core rooms, so that no pipeline stage but
sample-data has this code among its DVC deps (docs/architecture.md)."""
