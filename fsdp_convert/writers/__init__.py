"""Write stage: every output laid out before any data is read, so workers write tensors in place.

``torch_save`` and ``safetensors`` compute each tensor's byte range in its output file and write
the rest (headers, pickle, central directory) once the workers are done; ``dcp`` writes the
rank files and ``.metadata`` of a resharded checkpoint; ``_atomic`` keeps every output in a
temporary sibling until it is complete.
"""

from __future__ import annotations

from fsdp_convert.writers._atomic import atomic_output

__all__ = ["atomic_output"]
