"""The `triton` backend (SPEC §3): one module per op, each kernel beside its launcher."""
