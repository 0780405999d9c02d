"""OUT's file suffixes that name an output kind, in a leaf that imports nothing.

The output kinds (``outputs``) claim OUT by these, and the CLI refuses an unknown suffix before
torch is imported (``cli._precheck``) from the same tuples. A new file kind with a suffix of its
own adds it here and to its ``outputs`` entry.
"""

from __future__ import annotations

__all__ = ["TORCH_SAVE_SUFFIXES", "SAFETENSORS_SUFFIXES"]

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save of the nested state dict (``--format auto``)
SAFETENSORS_SUFFIXES = (".safetensors",)  # safetensors of the model weights
