import os
import sys

# `launch` is a top-level folder, not an installed package: make it importable in tests.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
