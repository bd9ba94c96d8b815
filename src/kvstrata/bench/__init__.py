"""Benchmark scenarios (one module each); see `kvstrata.cli.bench`."""
