"""``python -m distckpt ...``: the ``distckpt`` command line (where the console script is not on
``PATH``)."""

import sys

from ._cli.main import main

sys.exit(main())
