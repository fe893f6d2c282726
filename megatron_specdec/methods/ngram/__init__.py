"""The ngram draft method."""
