"""The shop's own test suite: how an application tests what it dispatches (docs/testing.md)."""
