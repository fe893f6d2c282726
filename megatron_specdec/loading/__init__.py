"""The front door from a path to a model (loading.source): identify a source's form, read its
metadata once, build this rank's stage and load it; HF import and export of base models
(hf_conversion), base and speculative checkpoints (base, speculative), base -> speculative
checkpoint conversion (conversion)."""
