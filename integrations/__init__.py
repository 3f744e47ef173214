"""Integrations with compiler stacks (torch.compile / Inductor custom passes)."""
