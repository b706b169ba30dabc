"""Generated gRPC stubs of `proto/grace/v1` (regenerate with `make proto`)."""
