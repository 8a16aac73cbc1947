"""Patching experiments: `sweep` and what it returns."""
