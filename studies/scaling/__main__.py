"""`python -m studies.scaling SUBCOMMAND ...`: the command line in `cli`."""

import sys

from .cli import main

sys.exit(main())
