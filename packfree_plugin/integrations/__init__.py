"""Adapters for libraries that build packed batches on their own terms: one module per library, each with the
releases it was tested with (docs/integrations.md)."""
