"""The contracts every part of GRACE serving shares (docs/ARCHITECTURE.md §1, "Layers"):
the targeting encoding, the index format and its validation, the SID tokenizer's files, the
publish protocol, data formats, SID spaces, RPC enums and the trie tables as tensors. They
import nothing of the project; the index builder, the kernels, the server, the C++ post
stage and the tests import them.
"""
