"""Test harness, not product: helpers only the tests use (a real MLflow server they can stop,
the streaming-memory check run in its own process). Importable as `support.*` because pytest
puts tests/ on the path (pyproject.toml). What notebooks or benchmarks also use lives in the
package (raytrain_lm.clusters.multinode)."""
