"""Flare: a local LLM inference server for NVIDIA GPUs."""

__version__ = "0.1.0"
