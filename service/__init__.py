"""The GRACE serving process: the `grace` CLI today; the gRPC server, batcher and the
four-stage pipeline (input -> features -> compute -> post) land with the service issue.
"""
