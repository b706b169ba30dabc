"""The four-stage pipeline (ARCHITECTURE.md §2, paper §2.5): input -> features -> compute -> post,
each stage on its own thread (and CUDA stream on GPU). `records.py` holds the typed
hand-offs, `stages.py` the stage bodies, `runner.py` the threads that connect them.
"""
