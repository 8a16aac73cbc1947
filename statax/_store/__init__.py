"""A store of captures on disk: `record` writes it, `open_store` reads it."""
