"""The RPC contract in the client: stubs generated from `proto/grace/v1/retrieval.proto`.

    from grace_client.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

`make proto` (tools/proto_stubs.py, at the repository root) regenerates them together with
the service's copy in `service/rpc`; nothing under `grace/` is edited by hand.
"""
