"""`python -m service.cli` = `grace`."""

import sys

from service.cli import main

if __name__ == "__main__":  # not when a spawned worker process imports it (`--workers`)
    sys.exit(main())
