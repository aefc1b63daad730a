"""A Flare recipe for LlamaForCausalLM, written only against Flare's public API."""
