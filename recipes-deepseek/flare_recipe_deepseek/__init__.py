"""Flare recipes for the DeepSeek-V3 architecture: DeepSeek-V3 / V3-0324 / V3.1. The model code
(`modeling`, `weights`, `checks`) is shared with other families whose checkpoints declare
DeepseekV3ForCausalLM (flare-recipe-kimi)."""
