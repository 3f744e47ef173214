"""Cost model, schedule simulator and timelines over the IR (imports ir/ only)."""
