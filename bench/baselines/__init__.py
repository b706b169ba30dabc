"""Implementations that are measured but not served: the baselines the benchmarks compare
the served path against (docs/PERFORMANCE.md, the paper's Tables 4–6 analogues).

cross_attention.py              the per-beam K/V layout (eq. 10); beam-as-query through SDPA
                                pinned to one backend (flash, cuDNN, memory-efficient)
kv_cache.py                     dense per-row KV (a reorder copies bytes); the paged cache
                                attending through gather + the coalesced kernel or SDPA
ladder.py                       the textbook decode loop (`TextbookSearch`), one `Rung`
                                switch per optimisation of the served engine it leaves out
                                (bench/bench_decoder_loop.py's ladder)
"""
