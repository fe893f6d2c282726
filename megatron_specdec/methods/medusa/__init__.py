"""The medusa draft method."""
