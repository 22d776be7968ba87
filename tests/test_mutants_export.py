"""Tests added to kill mutants of facepipe/export (tests/README.md)."""
