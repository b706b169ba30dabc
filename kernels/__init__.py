"""GPU kernels of the compute stage (docs/ARCHITECTURE.md §7). Each `X.py` is a typed
dispatcher with its torch reference (the CPU path and the tests' oracle); `_triton_X.py`
holds the Triton kernel it launches on CUDA tensors:

cross_attention.py  beam-as-query cross-attention (cuDNN SDPA on bf16, ours on fp32)
self_attention.py   one new SID token over the ≤ 4 cached prefix tokens (paged, fused)
gtm_mask.py         the CD+GTM mask + log-softmax + score of a decode step; `lookup`, the
                    reference CD+GTM lookup (paper §3.5)
beam_advance.py     a step's bookkeeping after top-k: parents, tokens, liveness, nodes
layer_norm.py       LayerNorm of `x + shift` (the decoder step's folded biases)
gelu_linear.py      the FFN up-projection with cuBLASLt's bias + GELU epilogue
fp8.py              FP8 e4m3 quantisation and GEMMs (rowwise; block-scaled for the FFN down)
fp8_ffn.py          the FP8 FFN up GEMM (persistent, TMA) with bias + GELU + 1 x 128
                    quantisation in its epilogue

Kernels that are measured but not served live in bench/baselines/.
"""
