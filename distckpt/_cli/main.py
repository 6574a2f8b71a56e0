"""Entry point: ``distckpt <command> ...`` (also ``python -m distckpt._cli``).

Each subcommand is one module with ``NAME``, ``HELP``, ``EPILOG``, ``add_arguments(parser)``
and ``run(args) -> int``; :data:`COMMANDS` lists them in help order.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys

from . import diff, export, import_, inspect_, interval, ls, memory, prune, release, verify
from ._common import add_common
from ._errors import EXIT_ERROR, describe

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = [ls, inspect_, interval, verify, diff, export, release, import_, prune, memory]


def build_parser() -> argparse.ArgumentParser:
    """The ``distckpt`` argument parser: one subcommand per module of :data:`COMMANDS`, each also
    taking ``--json`` and ``--debug``."""
    parser = argparse.ArgumentParser(
        prog="distckpt",
        description="Inspect, verify, compare, export and prune distckpt checkpoints; clean the memory tier's.",
        epilog="example: distckpt ls runs/demo/ckpt    (run `distckpt COMMAND --help` for each command)",
    )
    parser.add_argument("--debug", dest="debug_all", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        p = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.HELP,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        add_common(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI.

    Returns:
        The exit code: 0 ok, 1 a check failed / checkpoints differ, 2 error, 130 interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    debug = args.debug or args.debug_all
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except BrokenPipeError:  # `distckpt inspect ... | head`: the reader left; not an error
        _silence_stdout()
        return 0
    except BaseException as e:  # noqa: BLE001 - the one exception-to-message map
        known = describe(e)
        if debug or known is None:
            raise
        code, message = known
        print(f"distckpt {args.command}: error: {message}", file=sys.stderr)
        return code if code else EXIT_ERROR


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


if __name__ == "__main__":
    sys.exit(main())
