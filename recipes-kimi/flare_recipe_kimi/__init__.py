"""Flare recipes for the Kimi family (package skeleton: the recipes arrive with the MLA + MoE work)."""
