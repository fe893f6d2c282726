"""The eagle3 draft method."""
