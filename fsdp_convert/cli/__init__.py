"""Command-line interface (typer + rich); the only package that imports them."""

import os
import warnings

# torch's C++ warnings (a TCP store whose peer is gone, and the like) print stack dumps around the
# one error line; read once, when torch is imported, which has not happened yet.
if os.environ.get("FSDP_CONVERT_DEBUG", "") in ("", "0"):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# torch warns at import when NumPy is absent; this tool never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fsdp_convert.cli.app import app, main  # noqa: E402

__all__ = ["app", "main"]
