"""``python -m tests.chaos``: the chaos run (see the package docstring)."""

import sys

from tests.chaos.driver import main

sys.exit(main())
