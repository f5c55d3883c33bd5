"""Simulated engine and simulated GPU fixtures for the demo, tests and benchmarks."""
