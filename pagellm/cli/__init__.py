"""The `pagellm` command line (`pagellm.cli.main`); `python -m pagellm.cli` runs it too."""
from pagellm.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
