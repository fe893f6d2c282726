"""Hugging Face export and import of draft modules (EAGLE3, Medusa) for TensorRT-LLM, vLLM and
SGLang: `eagle3_hf.export_eagle3`, `medusa_hf.export_medusa`, `full_export.export_full`,
`draft_import.import_eagle3`. See docs/export.md."""
