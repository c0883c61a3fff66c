"""What an inference engine calls: the per-tensor `weight_loader` hook, checkpoint-name mapping,
`FusedMoEExperts` (an `nn.Module`), its `load_state_dict` hooks, model-level loading and the reference
forward."""
