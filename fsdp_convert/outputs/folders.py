"""Output kinds, a folder: ``HfFolder`` (Hugging Face weights, optimizer state beside) and ``PeftAdapterFolder``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.item import OutputItem
from fsdp_convert.lora import LoraOptions, write_adapter_config
from fsdp_convert.output_table import HF_INDEX_FILENAME, HF_ROW, HF_SHARD_FILENAME, HF_SINGLE_FILENAME, PEFT_ROW
from fsdp_convert.outputs.files import SafetensorsFile, TorchSaveFile, check_tensors
from fsdp_convert.outputs.kind import FilePlan, Only, RowKind
from fsdp_convert.roles import GROUPS, Group
from fsdp_convert.transform import TransformOptions
from fsdp_convert.transform.fp8 import QUANTIZATION_CONFIG, dequantizes
from fsdp_convert.writers.hf_assets import HfAssets, weights_dtype, write_hf_assets
from fsdp_convert.writers.safetensors import ShardFile, write_hf_index
from fsdp_convert.writers.transaction import writing

__all__ = ["plan_shards", "HfFolder", "PeftAdapterFolder"]


def plan_shards(items: Sequence[OutputItem], item_ids: Sequence[int], max_shard_bytes: int) -> tuple[FilePlan, ...]:
    """Pack tensors into shard files in order, as transformers' ``save_pretrained`` does, and place each.

    A new shard starts when the next tensor would take the current one past ``max_shard_bytes``;
    a tensor larger than that gets a shard of its own. One shard is named ``model.safetensors``;
    several ``model-0000k-of-0000n.safetensors`` (``output_table.HF_SHARD_FILENAME``).
    """
    groups: list[list[int]] = []
    size = 0
    for i in item_ids:
        nbytes = items[i].nbytes
        if not groups or (size + nbytes > max_shard_bytes and size > 0):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    n = len(groups)
    shard = SafetensorsFile()
    return tuple(
        shard.place(items, tuple(g), HF_SINGLE_FILENAME if n == 1 else HF_SHARD_FILENAME.format(k=k + 1, n=n), 0)
        for k, g in enumerate(groups)
    )


@dataclass(frozen=True, slots=True)
class HfFolder(RowKind):
    """A Hugging Face folder: the weights as safetensors shards, optimizer state and the rest beside them.

    The shards with ``model.safetensors.index.json`` when several, then the row's torch.save
    files (``OutputRow.folder_files``): the optimizer state in ``optimizer.pt``, other entries in
    ``extra_state.pt``; and ``--hf-assets``' config and tokenizer files.
    """

    row = HF_ROW

    def groups(self, only: Only) -> tuple[Group, ...]:
        """Every group, or the one ``--only`` names."""
        return GROUPS if only == "all" else (only,)

    def _weights(self, items: Sequence[OutputItem], ids: list[int], max_shard_bytes: int) -> tuple[FilePlan, ...]:
        return plan_shards(items, ids, max_shard_bytes)

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        """The weights' shards in shard order, then the row's torch.save files that have items.

        Each torch.save file holds its group's items, their paths without its ``nest`` (``optimizer.pt``
        holds the optimizer state dict itself, not ``{"optim": ...}``).
        """
        check_tensors(items)
        model_ids = [i for i, item in enumerate(items) if item.group == "model"]
        files = self._weights(items, model_ids, max_shard_bytes) if model_ids else ()
        for side in (f for f in self.row.folder_files if f.content == "torch_save"):
            ids = tuple(i for i, item in enumerate(items) if item.group == side.group)
            if ids:
                files += (TorchSaveFile().place(items, ids, side.name, len(side.nest)),)
        return files

    def shards(self, files: Sequence[FilePlan]) -> tuple[FilePlan, ...]:
        """The safetensors shards, in shard order."""
        return tuple(f for f in files if isinstance(f.kind, SafetensorsFile))

    def write_index(self, folder: Path, files: Sequence[FilePlan], items: Sequence[OutputItem]) -> int:
        """``model.safetensors.index.json`` for several shards (``writers.safetensors.write_hf_index``)."""
        shards = self.shards(files)
        if len(shards) <= 1:
            return 0
        listed = [
            ShardFile(
                filename=s.filename or "",
                paths=tuple(items[i].path for i in s.item_ids),
                tensor_bytes=sum(items[i].nbytes for i in s.item_ids),
            )
            for s in shards
        ]
        write_hf_index(folder / HF_INDEX_FILENAME, listed)
        return (folder / HF_INDEX_FILENAME).stat().st_size

    def finish(
        self,
        folder: Path,
        *,
        index: CheckpointIndex,
        items: Sequence[OutputItem],
        options: TransformOptions,
        assets: HfAssets | None,
    ) -> int:
        """Copy ``--hf-assets``' files, the config's dtype that of the weights written (``writers.hf_assets``)."""
        if assets is None:
            return 0
        dtype = weights_dtype(options.dtype, (i.dtype for i in items if i.group == "model" and i.is_tensor))
        with writing(folder):
            quantization = QUANTIZATION_CONFIG if options.quantize else None
            dequantized = options.dequantize or dequantizes(options.adapter)  # an hf-to-torchtitan-* adapter implies it
            written = write_hf_assets(assets, folder, dtype=dtype, quantization=quantization, dequantized=dequantized)
            return sum(p.stat().st_size for p in written)


@dataclass(frozen=True, slots=True)
class PeftAdapterFolder(HfFolder):
    """A PEFT adapter folder (``--lora-only``), as ``save_pretrained`` writes it.

    The adapter's tensors in one ``adapter_model.safetensors`` (PEFT reads one file, never
    shards), then ``adapter_config.json``.

    Attributes:
        lora: the LoRA options (``adapter_config.json``'s fields).
    """

    row = PEFT_ROW
    lora: LoraOptions | None = None

    def _weights(self, items: Sequence[OutputItem], ids: list[int], max_shard_bytes: int) -> tuple[FilePlan, ...]:
        weights = next(f.name for f in self.row.folder_files if f.content == "safetensors")  # adapter_model.safetensors
        return (SafetensorsFile().place(items, tuple(ids), weights, 0),)

    def finish(
        self,
        folder: Path,
        *,
        index: CheckpointIndex,
        items: Sequence[OutputItem],
        options: TransformOptions,
        assets: HfAssets | None,
    ) -> int:
        """``adapter_config.json`` (``lora.write_adapter_config``), then the folder's assets."""
        assert self.lora is not None  # output_kind sets it
        write_adapter_config(folder, self.lora, index, items)
        return HfFolder.finish(self, folder, index=index, items=items, options=options, assets=assets)
