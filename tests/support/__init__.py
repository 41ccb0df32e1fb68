"""Helpers shared by the tests (not test modules): import as `from support.engine import ...`."""
