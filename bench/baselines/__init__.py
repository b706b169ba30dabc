"""Implementations that are measured but not served: the baselines and the alternatives
the benchmarks compare the served path against (docs/PERFORMANCE.md).

cross_attention.py              per-beam K/V layout, SDPA pinned to one backend, the
                                persistent Triton kernel (`_triton_cross_attention_persistent`)
gelu_linear.py                  the persistent Triton GEMM with a GELU epilogue
                                (`_triton_gelu_linear`), beside the served cuBLASLt epilogue
kv_cache.py                     dense per-row KV (reorder copies bytes); gather + attend
decode_variants.py              the decode engine with one optimisation switched off at a
                                time (bench/bench_decoder_loop.py's ladder)
"""
