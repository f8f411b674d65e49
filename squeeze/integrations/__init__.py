"""Integrations with other runtimes (each imports its runtime lazily; squeeze works without them)."""
