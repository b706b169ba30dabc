"""Everything that turns an ads catalog into the indexes the server reads (ARCHITECTURE.md §3).

catalog.py   read + validate a catalog (catalog_parts/_files: readers; catalog_columns: checks)
tokenizer.py RQ-KMeans SID tokenizer for ads without a sid (kmeans.py, last_token.py)
trie.py      CSR GTM trie + deduplicated matcher tables; kway.py: k-way partitions
build.py     catalog -> arrays -> published version (publish.py; parallel.py: threads)
sidecar.py   `grace builder`: rebuild on catalog change
synth/       the synthetic ads world (demo, tests, training, evaluation)

The contracts it writes to — targeting encoding, on-disk format, validation — live in
`contracts/`, shared with the server and the kernels.
"""
