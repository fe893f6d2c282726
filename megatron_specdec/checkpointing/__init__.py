"""Storage: atomic directory commits, sharded dist-checkpoint save/load with the pickle guard,
checkpoint metadata, and the HF weight files and tables that are not method-specific. It never
builds a model (loading/ does)."""
