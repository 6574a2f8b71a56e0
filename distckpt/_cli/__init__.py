"""``distckpt`` command line: ``main(argv) -> int``. Thin commands over the library."""

from .main import main

__all__ = ["main"]
