"""The index as the server holds it (docs/ARCHITECTURE.md §3, §4).

loaded.py   `LoadedIndex`: one validated version with everything a batch reads from it
            (trie tables on the compute device, ads, location vocabulary, SID lookup,
            the C++ post stage), and `IndexHolder`, the current one
watcher.py  `IndexWatcher`: finds, validates, prepares and hot-swaps new versions
"""
