"""Under torchrun, for scripts/bench.py: re-save a DCP checkpoint's model with HuggingFaceStorageWriter.

Every rank makes empty DTensors sharded ``Shard(0)`` over the world (FSDP2's layout, the one the
sample training run saved), loads the ``model.*`` tensors of the DCP checkpoint into them with
``dcp.load``, and saves them with ``HuggingFaceStorageWriter(save_distributed=True)``: one
``shard-<rank>-model-00001-of-00001.safetensors`` per rank, unconsolidated, the input of torch's
``consolidate_safetensors_files``. The tensors are the same bytes as the DCP checkpoint's model.

    python -m torch.distributed.run --standalone --nproc-per-node=4 scripts/_bench_hf.py DCP_DIR OUT_DIR
"""

from __future__ import annotations

import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, empty


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        metadata = FileSystemReader(src).read_metadata()
        model = {
            fqn.removeprefix("model."): empty(md.size, dtype=md.properties.dtype, device_mesh=mesh, placements=[Shard(0)])
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata) and len(md.size) > 0
        }
        dcp.load({"model": model}, checkpoint_id=src)
        dcp.save(model, storage_writer=HuggingFaceStorageWriter(dst, save_distributed=True, enable_consolidation=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
