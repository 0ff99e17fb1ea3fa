"""fx adapters (being written)."""
