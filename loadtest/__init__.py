"""Locust load tests of the Retrieve RPC: `locustfile.py` is the entry point, the modules
beside it its parts (gRPC user, request sources, open-loop arrivals, thresholds)."""
