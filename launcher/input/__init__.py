"""Dataset distribution: splitting global batches, per-process loading, device fetch."""
