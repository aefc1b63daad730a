"""Kernels: Triton programs, FlashInfer wrappers and the torch custom ops that launch them, under
the model layers (flare_core.ops) that call them. They import nothing above them."""
