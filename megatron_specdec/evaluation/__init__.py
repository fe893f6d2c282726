"""Acceptance-length measurement over prompt sets (acceptance) and its plots (plots)."""
