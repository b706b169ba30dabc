"""Everything that turns an ads catalog into the indexes the server reads (docs/ARCHITECTURE.md §3).

catalog.py   read + validate a catalog (JSON Lines / Parquet)
  catalog_columns.py  its per-field checks: Arrow columns -> validated arrays
tokenizer.py RQ-KMeans SID tokenizer (ads without a sid)
  last_token.py       its last SID token (rank within a prefix) + CollisionReport
trie.py      CSR GTM trie + deduplicated matcher tables
kway.py      optional k-way partitioned matchers
build.py     catalog -> arrays -> published version
publish.py   atomic publishing under <root>/CURRENT
validate.py  full validation before an index may serve
sidecar.py   `grace builder`: rebuild on catalog change
synth/       the synthetic ads world (demo, tests, training, evaluation)

The contracts it writes to — the targeting encoding and the on-disk format — live in
`contracts/` (targeting.py, index_format.py), shared with the server and the kernels.
"""
