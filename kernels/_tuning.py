"""Whether the Triton launchers autotune (the default: benches and the server) or run each
kernel's fixed default config. The test suite sets `GRACE_AUTOTUNE=0` (tests/conftest.py)
so a GPU test run does not benchmark every config at every awkward shape it checks; tests
that sweep configs pass them explicitly. Read once, at import.
"""

import os

AUTOTUNE = os.environ.get("GRACE_AUTOTUNE", "1") != "0"
