"""Test harness for the collectives tests: the shim, a real coordinator, real rank processes."""
