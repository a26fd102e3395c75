"""Test helpers for the SPDK driver: the recorded layout as a config, keys, a running simulator."""
