"""Flare recipes for the Qwen3 family (dense and mixture-of-experts)."""
