"""Everything that turns an ads catalog into the indexes the server reads (docs/ARCHITECTURE.md §3).

catalog.py   read + validate a catalog (JSON Lines / Parquet)
tokenizer.py RQ-KMeans SID tokenizer (ads without a sid)
targeting.py the targeting encoding contract (bitmask, Bloom, exact rules)
trie.py      CSR GTM trie + deduplicated matcher tables
kway.py      optional k-way partitioned matchers
build.py     catalog -> arrays -> published version
format.py    the on-disk format (the one writer/reader pair)
publish.py   atomic publishing under <root>/CURRENT
validate.py  full validation before an index may serve
sidecar.py   `grace builder`: rebuild on catalog change
lookup.py    reference CD+GTM lookup (the decode step's mask; GPU kernel oracle)
exact.py     reference post stage: SID -> ads + exact filter
synth/       the synthetic ads world (demo, tests, training, evaluation)
"""
