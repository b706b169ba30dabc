"""The GRACE server: front, batcher, pipeline, model, decode, post (ARCHITECTURE.md §2)."""
