"""Helpers for tests and benchmarks: tiny models and tokenizers built locally (no downloads)."""
