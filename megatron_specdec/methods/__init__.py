"""Draft methods, one folder each (eagle3, medusa, draft_model, ngram, dflash): each exports
`METHOD`, a registry.DraftMethod, and is reached from the layers below only through
megatron_specdec.registry."""
