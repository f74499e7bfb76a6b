"""Benchmarks behind ``recscale bench`` (speed is measured here, never asserted in tests)."""
