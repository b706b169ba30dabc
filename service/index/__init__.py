"""The index as the server holds it: `loaded.py` (docs/ARCHITECTURE.md §3)."""
