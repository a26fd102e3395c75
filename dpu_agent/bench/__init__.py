"""Benchmarks behind `dpuctl bench ...`; each module defines one click command."""
