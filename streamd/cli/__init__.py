"""The `streamd` command line: one module per subcommand, dispatched by `main`."""

from streamd.cli.main import main

__all__ = ["main"]
