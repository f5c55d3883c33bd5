"""llmgw: a fleet of GPU nodes run as one LLM service."""

__version__ = "0.1.0"

__all__ = ["__version__"]
