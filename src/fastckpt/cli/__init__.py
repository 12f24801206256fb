"""The ``fastckpt`` command line: one click group, one module per subcommand.

Exit codes, for every subcommand: 0 pass, 1 a target missed or a check failed, 2 bad usage
(click's own code for usage errors). Each subcommand lives in its own module under ``cli/``
and is registered in ``_COMMANDS`` below (imported lazily so ``fastckpt --help`` stays fast).
"""

from __future__ import annotations

import importlib
import sys

import click

from ..errors import FastCkptError

# subcommand name -> "module:attribute" of its click.Command
_COMMANDS = {
    "latest": "fastckpt.cli.latest:latest",
    "plan": "fastckpt.cli.plan:plan",
    "bench": "fastckpt.cli.bench:bench",
    "drill": "fastckpt.cli.drill:drill",
    "ls": "fastckpt.cli.ls:ls",
    "verify": "fastckpt.cli.verify:verify",
    "rm": "fastckpt.cli.rm:rm",
    "doctor": "fastckpt.cli.doctor:doctor",
    "report": "fastckpt.cli.report:report",
    "serve-metrics": "fastckpt.cli.serve_metrics:serve_metrics",
}


class _LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or its help is shown)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        spec = _COMMANDS.get(name)
        if spec is None:
            return None
        module, attr = spec.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fastckpt")
def cli() -> None:
    """fastckpt operator tools: size, stress-test, drill and inspect checkpoint storage."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastckpt`` script; returns the exit code instead of exiting."""
    try:
        cli.main(args=argv, prog_name="fastckpt", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 1
    except SystemExit as exc:  # a subcommand's sys.exit(code)
        return int(exc.code or 0)
    except (FastCkptError, OSError) as exc:  # the project's own errors name the problem and the fix, and so
        # does the OSError of a read it cannot do (a note naming the file and the fix): no traceback
        click.echo("\n".join([f"fastckpt: {type(exc).__name__}: {exc}", *getattr(exc, "__notes__", ())]), err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
