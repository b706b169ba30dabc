"""The contracts every part of GRACE serving shares (docs/ARCHITECTURE.md §3, §5; docs/FORMAT.md).
They import nothing of the project; the index builder, the kernels, the server, the C++
post stage and the tests import them.

targeting.py     the eligibility contract: schema, bit layout, Bloom hashing, ad and
                 request encoding, request and catalog limits, the exact per-ad test
index_format.py  the on-disk index format: the one writer/reader pair
npy_private.py   reading an array file into private memory with its checksum
request.py       the RPC's enums (FilterMode, EventType) and the beam-schedule rule
tensors.py       the trie tables and encoded requests as torch tensors (GtmTables,
                 RequestTensors): what the CD+GTM mask reads
"""
