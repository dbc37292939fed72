"""Shared code for the course "Cheaper LLM inference, measured"."""
__version__ = "0.1.0"
