"""Simulated engine and simulated GPU fixtures for the demo, tests and benchmarks, and the chat
traffic (``workload``) that the demo and the chaos run send through a gateway."""
