"""Helpers for tests, examples and benchmarks: a local model built without any hub."""
