"""The ``fastckpt`` command line (subcommands arrive with their issues)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastckpt", description="fastckpt operator tools")
    sub = parser.add_subparsers(dest="cmd")
    p_latest = sub.add_parser("latest", help="print the newest complete checkpoint under a directory")
    p_latest.add_argument("root")
    args = parser.parse_args(argv)
    if args.cmd == "latest":
        from ..commit import latest

        found = latest(args.root)
        if found is None:
            print(f"no complete checkpoint under {args.root}", file=sys.stderr)
            return 1
        print(found)
        return 0
    parser.print_help()
    return 2
