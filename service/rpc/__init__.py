"""The RPC contract in Python: stubs generated from `proto/grace/v1/retrieval.proto`.

    from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

`generate.py` regenerates them (`make proto`); nothing under `grace/` is edited by hand.
This package imports nothing itself, so regeneration works even when the stubs are gone.
"""
