"""The index as the server holds it (docs/ARCHITECTURE.md §3, §4).

loaded.py   `LoadedIndex`: one validated version with everything a batch reads from it
            (trie tables on the compute device, ads, location vocabulary, SID lookup,
            the C++ post stage); `service/rollout/` loads and swaps them in
"""
