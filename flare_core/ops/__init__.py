"""Model layers of served models (nn.Modules holding parameters: attention over the paged cache,
MLA, the routers, FP8 and GEMV linears, the delta-rule layer, the DeepSeek-V3 architecture), their
weight mapping and loading, and `serving_model`. The kernels they call: flare_core.kernels."""
