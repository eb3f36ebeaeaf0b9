"""Pipeline-parallel point-to-point scheduler."""
