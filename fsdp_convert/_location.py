"""Where a checkpoint's bytes live: a local ``Path`` or a remote ``Url``; a leaf below the index and ``remote``.

``formats/index.py`` records these in every ``ChunkEntry`` and ``remote.py`` reads and writes them,
so both import the types from here (and ``remote`` needs nothing from the read side).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["Url", "Location"]


class Url(str):
    """A remote location (``s3://bucket/ckpt``) that joins like a ``Path``: ``url / "__0_0.distcp"``."""

    __slots__ = ()

    def __truediv__(self, other: str | os.PathLike[str]) -> Url:
        return Url(self.rstrip("/") + "/" + os.fspath(other))

    @property
    def name(self) -> str:
        """The last component."""
        return self.rstrip("/").rsplit("/", 1)[-1]


Location = Path | Url
