"""Benchmarks: each script starts the real stack and prints its figure beside a floor measured in the same run."""
