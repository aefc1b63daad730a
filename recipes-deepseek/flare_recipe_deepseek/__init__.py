"""Flare recipes for the Deepseek family (package skeleton: the recipes arrive with the MLA + MoE work)."""
