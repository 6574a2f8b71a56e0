"""``python -m distckpt._cli ...``."""

import sys

from .main import main

sys.exit(main())
