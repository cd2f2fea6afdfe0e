"""Dataset distribution: auto-sharding across workers, file-backed datasets, splitting global batches, device prefetch."""
