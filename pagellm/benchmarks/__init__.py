"""Benchmarks that ship with the package (`pagellm bench throughput|latency`) and their shared parts:
prompt sets, the request driver, result metadata, and the physical floors results are measured against."""
