"""Integrations with other engines (Ray Serve)."""
