"""Command-line interface (typer + rich); the only package that imports them."""

import warnings

# torch warns at import when NumPy is absent; this tool never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fsdp_convert.cli.app import app, main  # noqa: E402

__all__ = ["app", "main"]
