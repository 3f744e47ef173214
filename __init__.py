"""fxsched: schedule the collectives of FSDP training graphs in torch.fx."""
