"""Benchmarks: every speed or memory claim is a ratio against a baseline measured in the same run."""
