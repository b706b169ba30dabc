"""GPU kernels for the compute stage (docs/ARCHITECTURE.md §7): cross-attention beam-as-query,
short-sequence self-attention, the CD+GTM mask, top-k and reorder. Each lands with its
torch reference and a CPU/GPU dispatcher in the GPU fast-path issue (#5); until then the
reference implementations (e.g. `index_builder.lookup`) are the only path.
"""
