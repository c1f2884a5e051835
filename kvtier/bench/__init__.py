"""Benchmarks behind `kvtier bench`: side-by-side measurements of kvtier and its baselines."""
