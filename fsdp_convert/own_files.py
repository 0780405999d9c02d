"""The names a run of this tool writes in an output folder, as one record that tables contribute to.

``OwnFiles`` is a leaf record: the outputs table contributes the files each output kind writes,
the producers table the files each producer's checkpoint holds beside its data (which ``reshard``
copies), and the output check (``writers``) asks the union whether an existing folder is this
tool's own output (``--overwrite`` replaces it without ``--force``). Nothing here names a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OwnFiles"]


@dataclass(frozen=True, slots=True)
class OwnFiles:
    """Names of entries this tool writes at the top of an output folder.

    Attributes:
        files: patterns a top-level file's whole name matches (``re.fullmatch``).
        folders: (pattern of a top-level folder's name, pattern every entry inside it matches):
            a folder is the tool's own when its name matches and it holds only files whose names
            match the second pattern (one level; a subfolder inside makes it foreign).
    """

    files: tuple[re.Pattern[str], ...] = ()
    folders: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = ()

    def __or__(self, other: OwnFiles) -> OwnFiles:
        """Both records' names."""
        return OwnFiles(files=self.files + other.files, folders=self.folders + other.folders)

    def file(self, name: str) -> bool:
        """Whether a top-level file named ``name`` is one this tool writes."""
        return any(p.fullmatch(name) for p in self.files)

    def folder(self, name: str) -> re.Pattern[str] | None:
        """The pattern of the files a top-level folder named ``name`` may hold, or None: not a folder this tool writes."""
        return next((inner for outer, inner in self.folders if outer.fullmatch(name)), None)
