"""A rank's load: the plan (which tensors feed which fused slots), the reads of scales, zero points,
g_idx and weights, the fused layout and its writer, the completeness ledger, the device policy,
`load_experts` and the reader of pre-sharded outputs."""
