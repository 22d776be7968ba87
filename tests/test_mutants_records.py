"""Tests added to kill mutants of facepipe/records (tests/README.md)."""
