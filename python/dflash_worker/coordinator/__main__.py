"""`python -m dflash_worker.coordinator` runs the `dflash-coordinator` command line."""

import sys

from .cli import main

sys.exit(main())
