"""spdk_plugins: desired-state SPDK configuration, plan/apply, and an rpc.py plugin."""
