"""GPU kernels of the compute stage (docs/ARCHITECTURE.md §7 lists them). Each `X.py` is a
typed dispatcher with its torch reference (the CPU path and the tests' oracle);
`_triton_X.py` holds the Triton kernel it launches on CUDA tensors, which also runs on CPU
tensors under `TRITON_INTERPRET=1` (tests: set before the module is imported). `fp8.py`
and `fp8_ffn.py` serve the FP8 form of the decoder step (docs/FP8.md).
"""
