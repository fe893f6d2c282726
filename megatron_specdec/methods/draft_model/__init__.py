"""The draft_model draft method."""
