"""`python -m service.cli` = `grace`."""

import sys

from service.cli import main

sys.exit(main())
