"""The SID space: what a model and an index must share to work together (docs/DATA.md,
"SID spaces"). Its key, stored in the index manifest and the model checkpoint (the field
`tokenizer_fingerprint` of both, its name kept for format compatibility), is a SID
tokenizer's fingerprint for SIDs computed from embeddings, or `sid-space:<name>` for SIDs
made elsewhere (TIGER, GRID, ...) that every catalog row carries (`grace train
--sid-space`, `grace build-index --sid-space`). The server refuses an index whose key
differs from the model's.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

# How a SID tokenizer makes the last SID token (`TokenizerConfig.last_token`,
# docs/TOKENIZER.md): "rank" ranks the ads sharing a prefix (TIGER: ~1 ad per SID),
# "code" is one more RQ-KMeans level (the ads of one creative share the full SID).
LastToken = Literal["rank", "code"]
LAST_TOKENS: tuple[LastToken, ...] = get_args(LastToken)

PREFIX = "sid-space:"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def named(name: str) -> str:
    """The key of a named SID space; ValueError for a name that is not 1-64 characters
    of letters, digits, '.', '_' and '-' starting with a letter or digit."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"SID space name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return PREFIX + name


def is_named(key: str) -> bool:
    return key.startswith(PREFIX)
