"""Benchmarks: question files, metrics from step logs, the side-by-side runner, the simulator, reports."""
