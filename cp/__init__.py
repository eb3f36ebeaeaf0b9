"""Context-parallel tensor helpers (see issue: the cp package)."""
