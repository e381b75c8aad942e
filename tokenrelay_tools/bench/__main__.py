"""`python -m tokenrelay_tools.bench ...`: the same as `tokenrelay bench ...`."""

import sys

from .cli import main

sys.exit(main())
