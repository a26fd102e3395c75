"""What each SPDK release the driver supports serves: recorded `rpc_get_methods` and the
parameter names of the methods the driver sends (`<release>.json`, docs/SPDK.md "Versions")."""
