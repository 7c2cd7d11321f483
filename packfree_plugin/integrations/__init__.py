"""Integrations with training libraries built on transformers (TRL, sentence-transformers)."""
