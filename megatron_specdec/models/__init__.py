"""Models: the GPT families and their provider, the speculative GPT wrapper a draft method
attaches to, the embedded default model, and the layers shared by every method (models/layers)."""
