"""Adapters for training libraries built on transformers (TRL, sentence-transformers): one module per library,
each with the releases it was tested with (docs/integrations.md)."""
