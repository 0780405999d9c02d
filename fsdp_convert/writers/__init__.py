"""Write stage: every output laid out before any data is read, so workers write tensors in place.

``torch_save`` and ``safetensors`` compute each tensor's byte range in its output file and write
the rest (headers, pickle, central directory) once the workers are done; ``dcp`` writes the
rank files and ``.metadata`` of a resharded checkpoint; ``transaction.OutputTransaction`` is the
one context an operation writes its output in (the check of OUT, staging for a URL, lock, space
check, temporary and manifest, rename into place, upload).

The names here import no torch, so the CLI checks OUT and reports a kept temporary before torch
is loaded; ``writers.transaction`` re-exports them with the rest.
"""

from __future__ import annotations

from fsdp_convert.writers._atomic import atomic_output, kept_note
from fsdp_convert.writers._output_check import check_output

__all__ = ["atomic_output", "check_output", "kept_note"]
