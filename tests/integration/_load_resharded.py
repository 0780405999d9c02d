"""Run under torchrun: load a resharded checkpoint into FSDP2 at this world size and check it.

python -m torch.distributed.run --standalone --nproc-per-node=M -m tests.integration._load_resharded CKPT TRUTH WORKDIR
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from tests.integration.test_reshard import _load_at_new_world_size

if __name__ == "__main__":
    checkpoint, truth, work = map(Path, sys.argv[1:4])
    dist.init_process_group("gloo")
    _load_at_new_world_size(dist.get_rank(), dist.get_world_size(), checkpoint, truth, work)
    dist.barrier()  # rank 0 checks longest; wait for it
    # Leave without tearing gloo down: under load its teardown at exit sometimes aborts a rank
    # ("terminate called without an active exception"), which says nothing about the load tested.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
