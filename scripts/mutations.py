#!/usr/bin/env python
"""Break the code on purpose, one claim at a time, and check that the test backing it fails.

Each mutation below names a claim of README.md or docs/, a one-place edit of the package (``old`` must occur
exactly once in ``file``) and the test that backs the claim. For each, the tracked and untracked
(not ignored) files are copied to a temporary folder, the edit is applied there, and that one
test runs from the copy with ``PYTHONPATH`` pointing at it (so forked ranks, spawned workers and
``python -m fsdp_convert`` subprocesses import the mutated package, not this checkout). A
mutation is *caught* when the test fails. Nothing in this checkout is changed.

Usage (from the repository root, after ``scripts/setup.sh``):

    .venv/bin/python scripts/mutations.py                 # every mutation, a table at the end
    .venv/bin/python scripts/mutations.py --list          # names and claims
    .venv/bin/python scripts/mutations.py --check         # each edit still applies and its test file exists (after a refactor); runs nothing
    .venv/bin/python scripts/mutations.py NAME [NAME...]  # some of them
    .venv/bin/python scripts/mutations.py --baseline NAME # also run the test unmutated (must pass)
    .venv/bin/python scripts/mutations.py --try FILE OLD NEW TEST   # an ad-hoc mutation

Not part of CI: each mutation runs a test that trains its own fixtures (seconds to minutes). There are
114 of them; ``--list`` names them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: replace ``old`` by ``new`` in ``file``; ``test`` must then fail."""

    name: str
    claim: str
    file: str
    old: str
    new: str
    test: str


MUTATIONS: list[Mutation] = [
    # --- consolidate: bitwise, safe, checked (guarded before issue 11; listed so anyone can re-check) ---
    Mutation(
        "chunk-placed-at-row-0",
        "consolidate: every tensor bitwise equal to the run's own full state dict",
        "fsdp_convert/move.py",
        "dst = job.offset + (lo - first) * itemsize",
        "dst = job.offset",
        "tests/integration/test_consolidate.py::test_consolidate_pt_equals_ground_truth",
    ),
    Mutation(
        "crc-never-compared",
        "CRC-32: every zip record of every payload is checked as it is read (a payload decoded: object storage, a view)",
        "fsdp_convert/formats/_range.py",
        "if h.crc != h.record.crc32:",
        "if False:",
        "tests/unit/test_move.py::test_corrupt_chunk_is_refused[False-dim0-offsets0-5-None-None]",
    ),
    Mutation(
        "metadata-unpickler-admits-all",
        ".metadata is read with an unpickler that admits only DCP's metadata classes",
        "fsdp_convert/formats/_dcp_metadata.py",
        "raise RefusedError(unknown_global(module, name))",
        'return getattr(__import__("importlib").import_module(module), name)',
        "tests/cli/test_bad_inputs.py::test_bad_input_fails_cleanly[.metadata would run code]",
    ),
    Mutation(
        "payload-not-weights-only",
        "every payload is decoded with torch.load(weights_only=True)",
        "fsdp_convert/formats/dcp.py",
        'map_location="cpu", weights_only=True)',
        'map_location="cpu", weights_only=bool(0))',
        "tests/cli/test_bad_inputs.py::test_bad_input_fails_cleanly[payload would run code]",
    ),
    Mutation(
        "data-file-may-escape",
        "data file names must stay inside the checkpoint folder",
        "fsdp_convert/formats/_dcp_metadata.py",
        'if Path(rel).is_absolute() or ".." in parts or len(parts) != 1:',
        "if False:",
        "tests/unit/test_formats_dcp.py::test_data_file_outside_the_folder_is_refused",
    ),
    Mutation(
        "overlap-not-checked",
        "chunks must tile each tensor exactly (overlap)",
        "fsdp_convert/formats/_coverage.py",
        "            if start != end:",
        "            if start > end:",
        "tests/unit/test_formats_index.py::test_gaps_overlaps_and_outside_chunks_are_coverage_errors",
    ),
    Mutation(
        "gap-not-checked",
        "chunks must tile each tensor exactly (gap)",
        "fsdp_convert/formats/_coverage.py",
        "    if covered < entry.numel:",
        "if False:",
        "tests/cli/test_bad_inputs.py::test_bad_input_fails_cleanly[chunks leave a gap]",
    ),
    Mutation(
        "existing-output-overwritten",
        "An existing OUT is an error (exit 4) unless --overwrite",
        "fsdp_convert/writers/_output_check.py",
        "    if not overwrite and not (is_dir and directory is not False and _empty(output) and not _mount_point(output)):\n        raise OutputExistsError",
        "    if False:\n        raise OutputExistsError",
        "tests/cli/test_precheck.py::test_output_checks_as_the_library_says",
    ),
    Mutation(
        "gather-through-numpy",
        "a plain pip install of the wheel (no extras) runs the main job with several workers: numpy is not a dependency",
        "fsdp_convert/_local_workers.py",
        "            out.append(json.loads(self._recv(src)))",
        '            out.append(json.loads(bytes(__import__("numpy").frombuffer(self._recv(src), dtype="uint8"))))',
        "tests/integration/test_without_numpy.py",
    ),
    Mutation(
        "undeclared-import",
        "every runtime import is a declared dependency",
        "fsdp_convert/formats/_dcp_folders.py",
        "\nimport logging\n",
        "\nimport logging\nimport numpy  # noqa: F401\n",
        "tests/unit/test_dependencies.py",
    ),
    Mutation(
        "lock-written-through-a-link",
        "every file the tool creates or opens for writing is opened without following a symbolic link",
        "fsdp_convert/writers/_nofollow.py",
        "elif st.st_nlink != 1:",
        "elif False:",
        "tests/unit/test_writers_nofollow.py::test_the_lock_is_never_written_through_a_link",
    ),
    Mutation(
        "output-may-be-the-input",
        "OUT may not be the input, inside it, or one of its ancestors (exit 2), --overwrite or not",
        "fsdp_convert/writers/_output_check.py",
        "        if relation is not None:",
        "        if False:",
        "tests/unit/test_writers_output_check.py::test_out_may_not_be_the_input_inside_it_or_around_it",
    ),
    Mutation(
        "metadata-trailing-bytes-accepted",
        "bytes after the .metadata pickle are refused",
        "fsdp_convert/formats/_dcp_metadata.py",
        "    if unpickler.end != len(data):",
        "    if False:",
        "tests/unit/test_formats_dcp.py::test_bytes_after_the_metadata_pickle_are_refused",
    ),
    Mutation(
        "stride-0-local-tensor-read",
        "a stride-0 local tensor in a rank file is refused, not written out as 1 GiB",
        "fsdp_convert/formats/_rank_pieces.py",
        "        if stride < span:",
        "        if False:",
        "tests/integration/test_hostile_sizes.py::test_a_stride_0_local_tensor_is_refused_not_written_as_1_gib",
    ),
    Mutation(
        "resume-beside-a-live-run",
        "--resume beside a live run names it (exit 4) and suggests no removal",
        "fsdp_convert/writers/_temporary.py",
        "        check_not_locked(output, tag)  # a live run's temporary is not an interrupted one",
        "        pass",
        "tests/integration/test_hostile_output.py::test_resume_beside_a_live_run_names_it_and_suggests_no_removal",
    ),
    Mutation(
        "hash-flooding-keys-accepted",
        "no quadratic trap in a small file: dict keys or set elements made to share one hash are refused",
        "fsdp_convert/formats/_safe_pickle.py",
        "            if counts[h] > MAX_SAME_HASH:",
        "            if False:",
        "tests/unit/test_unpickler_hostile.py::test_keys_made_to_share_one_hash_are_refused",
    ),
    Mutation(
        "usage-errors-answered-after-torch",
        "a usage error (an existing OUT, a bad suffix, --dtype fp8, a missing checkpoint) is answered before torch is imported",
        "fsdp_convert/cli/consolidate_cmd.py",
        "        check_consolidate(\n",
        '        __import__("torch")\n        check_consolidate(\n',
        "tests/cli/test_precheck.py::test_usage_errors_come_before_torch[existing OUT]",
    ),
    Mutation(
        "safetensors-bf16-as-f16",
        "OUT ending in .safetensors: the model weights, read by safetensors.torch.load_file",
        "fsdp_convert/dtypes.py",
        '"bfloat16": "BF16",',
        '"bfloat16": "F16",',
        "tests/integration/test_consolidate.py::test_consolidate_safetensors_holds_model_weights",
    ),
    Mutation(
        "hf-index-misnames-keys",
        "a Hugging Face folder that from_pretrained loads with the trained logits",
        "fsdp_convert/writers/safetensors.py",
        "weight_map = {safetensors_name(p): shard.filename",
        'weight_map = {safetensors_name(p) + "_": shard.filename',
        "tests/integration/test_hf.py::test_from_pretrained_gives_the_trained_logits",
    ),
    Mutation(
        "producer-never-fsdp2",
        "inspect names the producer",
        "fsdp_convert/producers/detect.py",
        'if any(c.numel == 0 for e in small for c in e.chunks):\n        return "fsdp2"',
        'if any(c.numel == 0 for e in small for c in e.chunks):\n        return "fsdp1"',
        "tests/unit/test_producers.py::test_detects_fsdp2",
    ),
    Mutation(
        "s3-reads-whole-objects",
        "A remote checkpoint is read by ranges: each chunk payload with one ranged GET",
        "fsdp_convert/remote.py",
        "return bytes(_fs(url).cat_file(str(url), start=offset, end=offset + length))",
        "return bytes(_fs(url).cat_file(str(url)))[offset : offset + length]",
        "tests/integration/test_object_storage.py::test_consolidate_from_and_to_s3_matches_local",
    ),
    Mutation(
        "cast-touches-step",
        "--optim-dtype casts the optimizer state; integer tensors and step never change",
        "fsdp_convert/transform/__init__.py",
        'dtype = _cast(entry, options.optim_dtype, keep=slot.key == "step")',
        "dtype = _cast(entry, options.optim_dtype, keep=False)",
        "tests/integration/test_transforms.py::test_rename_filter_and_cast_apply_to_model_and_optimizer",
    ),
    Mutation(
        "exclude-ignored",
        "--include GLOB / --exclude GLOB on model FQNs",
        "fsdp_convert/transform/__init__.py",
        "return not any(fnmatch.fnmatchcase(fqn, g) for g in options.exclude)",
        "return True",
        "tests/integration/test_transforms.py::test_rename_filter_and_cast_apply_to_model_and_optimizer",
    ),
    Mutation(
        "rename-collision-silent",
        "--rename: two keys renamed to one is an error naming both",
        "fsdp_convert/transform/__init__.py",
        "if out in seen:",
        "if False:",
        "tests/integration/test_transforms.py::test_bad_transforms_are_usage_errors",
    ),
    Mutation(
        "ids-reversed",
        "--optim-keys ids keys optimizer state by integer in the optimizer's own order",
        "fsdp_convert/transform/__init__.py",
        "return DictKey(ids[param])",
        "return DictKey(len(ids) - 1 - ids[param])",
        "tests/integration/test_transforms.py::test_ids_follow_the_optimizers_own_order",
    ),
    Mutation(
        "wrapper-names-kept",
        "Wrapper names (_orig_mod., ...) are removed from model and optimizer FQNs",
        "fsdp_convert/transform/__init__.py",
        'parts = [p for p in fqn.split(".") if p not in WRAPPER_NAMES]',
        'parts = fqn.split(".")',
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[fsdp2-wrapper-names]",
    ),
    Mutation(
        "verify-drops-differences",
        "verify: exit 1 with a table of the differing, missing and extra keys",
        "fsdp_convert/ops/verify.py",
        'diffs += [Difference(key=k, kind="differs", detail=d) for k, d in (differing or [])]',
        "diffs += []",
        "tests/integration/test_consolidate.py::test_verify_reports_differing_missing_and_extra",
    ),
    Mutation(
        "rank-file-builds-real-classes",
        "Per-rank files: DTensor, DeviceMesh and ShardedTensor are read as inert records (no process group)",
        "fsdp_convert/formats/_rank_unpickler.py",
        "if full in self._classes:\n            return self._classes[full]",
        'if full in self._classes:\n            return getattr(__import__("importlib").import_module(module), name)',
        "tests/integration/test_producers.py::test_rank_files_never_build_a_mesh",
    ),
    Mutation(
        "gather-takes-rank-1s-pieces-for-every-rank",
        "every worker writes its own tensors there (`pwrite`) ...; only offsets and CRC-32s go to rank 0 (as JSON), which writes the headers, the pickle and the central directory last. The output is byte-identical for any `--nproc` and `--nnodes`.",
        "fsdp_convert/_local_workers.py",
        "            out.append(json.loads(self._recv(src)))",
        "            out.append(out[1] if len(out) > 1 else json.loads(self._recv(src)))",
        "tests/integration/test_consolidate.py::test_consolidate_nproc3_is_byte_identical_to_nproc1",
    ),
    Mutation(
        "only-rank-0-writes-into-shards",
        "Workers write tensors into any shard; rank 0 writes the headers and the index.",
        "fsdp_convert/ops/_consolidate_rank.py",
        "if item.is_tensor and plan.owners[i] == rank:",
        'if item.is_tensor and plan.owners[i] == rank and (rank == 0 or file.output_format != "safetensors"):',
        "tests/integration/test_consolidate.py::test_consolidate_nproc3_is_byte_identical_to_nproc1",
    ),
    Mutation(
        "verify-option-never-fails",
        "`--verify` reads the written output back and compares it with the checkpoint, tensor by tensor, before it is moved into place.",
        "fsdp_convert/ops/consolidate.py",
        "if not check.equal:",
        "if False:",
        "tests/integration/test_consolidate.py::test_verify_option_catches_a_corrupt_write",
    ),
    Mutation(
        "write-path-loses-sign-of-zero",
        "compares every tensor bitwise with the run's own full state dict",
        "fsdp_convert/move.py",
        "pwrite_all(fd, view, dst + done - begin)",
        "pwrite_all(fd, memoryview(torch.frombuffer(view, dtype=torch.float32).add(0.0).numpy().tobytes()) if len(view) % 4 == 0 else view, dst + done - begin)",
        "tests/integration/test_consolidate.py::test_consolidate_pt_equals_ground_truth[ws3_fp32]",
    ),
    Mutation(
        "write-path-canonicalizes-nan",
        "compares every tensor bitwise with the run's own full state dict",
        "fsdp_convert/move.py",
        "pwrite_all(fd, view, dst + done - begin)",
        "pwrite_all(fd, memoryview((lambda t: torch.where(t.isnan(), torch.nan, t))(torch.frombuffer(view, dtype=torch.float32)).numpy().tobytes()) if len(view) % 4 == 0 else view, dst + done - begin)",
        "tests/integration/test_consolidate.py::test_consolidate_pt_equals_ground_truth[ws3_fp32]",
    ),
    Mutation(
        "cast-drops-nan",
        "`--dtype fp32|bf16|fp16` casts floating-point model tensors; `--optim-dtype` the optimizer state",
        "fsdp_convert/move.py",
        "dst.copy_(sources[id(chunk)].rows(a - c0, b - c0))",
        "dst.copy_(sources[id(chunk)].rows(a - c0, b - c0).nan_to_num() if job.dtype != entry.dtype else sources[id(chunk)].rows(a - c0, b - c0))",
        "tests/integration/test_transforms.py::test_rename_filter_and_cast_apply_to_model_and_optimizer",
    ),
    Mutation(
        "reshard-loses-sign-of-zero",
        "compares every tensor bitwise with the run's own full state dict",
        "fsdp_convert/move.py",
        "pwrite_all(fd, view, dst + done - begin)",
        "pwrite_all(fd, memoryview(torch.frombuffer(view, dtype=torch.float32).add(0.0).numpy().tobytes()) if len(view) % 4 == 0 else view, dst + done - begin)",
        "tests/integration/test_reshard.py::test_resharded_checkpoint_reads_with_torch_dcp_to_torch_save",
    ),
    Mutation(
        "verify-tolerance-nan-unequal",
        "Tensors must match in dtype, shape and bits (or within `--atol`/`--rtol`)",
        "fsdp_convert/ops/_compare.py",
        "equal_nan=True",
        "equal_nan=False",
        "tests/integration/test_consolidate.py::test_verify_reports_differing_missing_and_extra",
    ),
    Mutation(
        "verify-detail-nan-max",
        "Exit 0 when equal, 1 with a table (or `--json`) of the differing, missing (only in A) and extra (only in B) keys.",
        "fsdp_convert/ops/_compare.py",
        "diff = torch.where(alike | nan_a | nan_b, 0.0, (values_a - values_b).abs()).max().item()",
        "diff = torch.where((values_a == values_b) | (nan_a ^ nan_b), 0.0, (values_a - values_b).abs()).max().item()",
        "tests/integration/test_consolidate.py::test_verify_reports_differing_missing_and_extra",
    ),
    Mutation(
        "torchtitan-not-detected",
        "`inspect` names the producer (`producer: ...`)",
        "fsdp_convert/producers/detect.py",
        'and bool(tops & {"optimizer", "train_state", "lr_scheduler", "dataloader"})',
        "and False",
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[torchtitan]",
    ),
    Mutation(
        "torchtitan-groups-not-rebuilt",
        "param groups are rebuilt from the per-parameter copies",
        "fsdp_convert/roles.py",
        'if kind == "param_groups" and fqn:',
        'if kind == "param_group" and fqn:',
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[torchtitan]",
    ),
    Mutation(
        "torchtitan-ids-not-in-optimizer-order",
        "`--optim-keys ids` keys optimizer state, and each param group's `params`, by integer in the model's parameter order, the form `torch.optim.Optimizer.state_dict()` returns",
        "fsdp_convert/transform/__init__.py",
        "order = [p for g in sorted(groups) for p in groups[g].params]",
        "order = sorted(p for g in sorted(groups) for p in groups[g].params)",
        "tests/integration/test_producers.py::test_resume_on_one_process_matches_the_fsdp_next_step[torchtitan]",
    ),
    Mutation(
        "torchtitan-reshard-nests-weights",
        "a torchtitan checkpoint keeps its top-level weights and flattened optimizer state",
        "fsdp_convert/transform/__init__.py",
        'else () if keep_layout else ("model",)',
        'else ("model",)',
        "tests/integration/test_producers.py::test_reshard_keeps_the_producer_layout[torchtitan]",
    ),
    Mutation(
        "torchtitan-parent-no-hint",
        "the parent folder answers with the `step-N/` to pass",
        "fsdp_convert/formats/_dcp_folders.py",
        "    if len(subs) == 1:",
        "    if len(subs) == 0:",
        "tests/integration/test_producers.py::test_parent_folder_errors_name_the_folder_to_pass",
    ),
    Mutation(
        "accelerate-optimizer-folder-ignored",
        "`save_state`'s folder: `pytorch_model_fsdp_0/` + `optimizer_0/`, two DCP folders, and `random_states_<r>.pkl` | pass the parent folder",
        "fsdp_convert/formats/_dcp_folders.py",
        'ACCELERATE_DIR_RE = re.compile(r"(pytorch_model_fsdp|optimizer)_\\d+")',
        'ACCELERATE_DIR_RE = re.compile(r"(pytorch_model_fsdp)_\\d+")',
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[accelerate]",
    ),
    Mutation(
        "accelerate-pickles-loaded",
        "the pickles are never loaded",
        "fsdp_convert/formats/_dcp_folders.py",
        "    parts = [d for d in subs if ACCELERATE_DIR_RE.fullmatch(d.name)]",
        '    parts = [d for d in subs if ACCELERATE_DIR_RE.fullmatch(d.name)] + [__import__("pickle").load(open(p, "rb")) for p in root.glob("random_states_*.pkl")][:0]',
        "tests/integration/test_producers.py::test_accelerate_random_states_are_never_unpickled",
    ),
    Mutation(
        "lightning-meta-ignored",
        "`lightning` | DCP with `meta.pt` beside `.metadata`",
        "fsdp_convert/producers/detect.py",
        "return not index.folders and LIGHTNING_META_FILENAME in index.beside",
        "return False",
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[lightning-fsdp2]",
    ),
    Mutation(
        "optimizer-key-not-read-as-optim",
        'Output is always the nested layout `{"model": ..., "optim": {"state": ..., "param_groups": [...]}, <other keys as saved>}` whatever the producer\'s nesting.',
        "fsdp_convert/roles.py",
        'OPTIM_TOPS = ("optim", "optimizer")',
        'OPTIM_TOPS = ("optim",)',
        "tests/integration/test_producers.py::test_each_producer_consolidates_to_its_ground_truth[lightning-fsdp1]",
    ),
    Mutation(
        "reshard-reads-every-chunk",
        "Only the source chunks a target chunk meets are read (a chunk that must be decoded too: a remote source, a stream-transformed payload).",
        "fsdp_convert/formats/reader.py",
        "            if chunk.numel == 0 or any(a >= b for a, b in zip(lo, hi, strict=True)):\n                continue\n            if _read_in_place(",
        "            data = self.read_chunk(entry, chunk) if chunk.numel else None\n            if chunk.numel == 0 or any(a >= b for a, b in zip(lo, hi, strict=True)):\n                continue\n            if _read_in_place(",
        "tests/unit/test_move.py::test_fallback_to_decode_gives_the_same_bytes[dim0-rows1-None]",
    ),
    Mutation(
        "reshard-reads-whole-tensor-per-target-chunk",
        "Only the source chunks a target chunk meets are read.",
        "fsdp_convert/move.py",
        "chunks = sorted((c for c in entry.chunks if c.numel > 0 and _overlaps(c, r0, r1)), key=lambda c: c.offsets)",
        "chunks = sorted((c for c in entry.chunks if c.numel > 0 and (self.reader.locate(entry, c) is None or True) and _overlaps(c, r0, r1)), key=lambda c: c.offsets)",
        "tests/integration/test_reshard.py::test_reshard_reads_only_the_source_chunks_a_target_chunk_meets[4-1]",
    ),
    Mutation(
        "reshard-array-split-not-torch-chunk",
        "Every tensor is split on dim 0 in `torch.chunk(M)` order (FSDP2's `Shard(0)` and FSDP1's sharded layout)",
        "fsdp_convert/plan/reshard.py",
        "        start = rank * step\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(min(step, rows - start), *shape[1:])))",
        "        start = rank * (rows // world_size) + min(rank, rows % world_size)\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(rows // world_size + (rank < rows % world_size), *shape[1:])))",
        "tests/integration/test_reshard.py::test_reshard_round_trip_consolidates_byte_identical[4]",
    ),
    Mutation(
        "reshard-array-split-torchtitan-loader",
        "so its producer's loader reads the result: ... a torchtitan checkpoint keeps its top-level weights and flattened optimizer state (at world size M each rank reads only its own file)",
        "fsdp_convert/plan/reshard.py",
        "        start = rank * step\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(min(step, rows - start), *shape[1:])))",
        "        start = rank * (rows // world_size) + min(rank, rows % world_size)\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(rows // world_size + (rank < rows % world_size), *shape[1:])))",
        "tests/integration/test_reshard_oracles.py::test_torchtitan_reshard_loads_the_way_torchtitan_loads_at_three_ranks",
    ),
    Mutation(
        "reshard-array-split-fsdp1-rank-files",
        "Any source in the table of producers.md works, including per-rank files ..., which become a regular DCP folder (split in `torch.chunk(M)` order)",
        "fsdp_convert/plan/reshard.py",
        "        start = rank * step\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(min(step, rows - start), *shape[1:])))",
        "        start = rank * (rows // world_size) + min(rank, rows % world_size)\n        if start >= rows:\n            break\n        offsets = (start, *(0,) * (len(shape) - 1))\n        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(rows // world_size + (rank < rows % world_size), *shape[1:])))",
        "tests/integration/test_reshard_oracles.py::test_fsdp1_rank_files_reshard_is_the_run_as_dcp",
    ),
    Mutation(
        "reshard-rank-files-reversed",
        "rank r's chunks in `__r_0.distcp`, so at world size M each rank reads only its own file",
        "fsdp_convert/plan/reshard.py",
        "chunks.append(TargetChunk(rank=rank, offsets=offsets,",
        "chunks.append(TargetChunk(rank=world_size - 1 - rank, offsets=offsets,",
        "tests/integration/test_reshard.py::test_reshard_round_trip_consolidates_byte_identical[4]",
    ),
    Mutation(
        "reshard-bytes-entries-off-rank-0",
        "bytes entries (param groups, train state) are carried over unchanged, both in rank 0's file",
        "fsdp_convert/ops/_reshard_rank.py",
        "            pwrite_all(fd, memoryview(raw), at)\n            stored.append(StoredChunk(dcp_key(item.path), None, rank_filename(0), at, len(raw)))",
        '            last = rank_filename(plan.target_world_size - 1)\n            with open(job.tmp_output / last, "ab") as f:\n                where = f.tell()\n                f.write(raw)\n            stored.append(StoredChunk(dcp_key(item.path), None, last, where, len(raw)))',
        "tests/integration/test_reshard.py::test_reshard_round_trip_consolidates_byte_identical[4]",
    ),
    Mutation(
        "reshard-whole-tensors-off-rank-0",
        "0-dim tensors (`step`) and tensors the source kept whole on every rank stay whole, ... both in rank 0's file",
        "fsdp_convert/plan/reshard.py",
        "chunks.append((TargetChunk(rank=0, offsets=(0,) * len(shape), sizes=shape),))",
        "chunks.append((TargetChunk(rank=target_world_size - 1, offsets=(0,) * len(shape), sizes=shape),))",
        "tests/integration/test_reshard.py::test_reshard_round_trip_consolidates_byte_identical[4]",
    ),
    Mutation(
        "reshard-splits-tensors-the-source-kept-whole",
        "0-dim tensors (`step`) and tensors the source kept whole on every rank stay whole, ... both in rank 0's file",
        "fsdp_convert/plan/reshard.py",
        "replicated = item.derived is None and index.world_size > 1 and len(full) == 1 and full[0].sizes == e.shape",
        "replicated = False",
        "tests/integration/test_reshard_oracles.py::test_torchtitan_reshard_is_the_run_in_torchtitans_layout",
    ),
    Mutation(
        "reshard-planner-data-dictkeys-unconverted",
        "The result needs nothing from this tool: ... torch's `dcp_to_torch_save`; per-rank files ... become a regular DCP folder",
        "fsdp_convert/writers/dcp.py",
        "planner_data={e.fqn: plain_path(e.path) for",
        "planner_data={e.fqn: e.path for",
        "tests/integration/test_reshard_oracles.py::test_verl_reshard_is_the_run_as_dcp",
    ),
    Mutation(
        "verl-local-tensor-reversed",
        "Any source in the table of producers.md works, including per-rank files ..., which become a regular DCP folder (holding the run's state)",
        "fsdp_convert/formats/_records.py",
        'return obj.fields["_local_tensor"]',
        'return obj.fields["_local_tensor"].flip(-1) if obj.fields["_local_tensor"].dim() else obj.fields["_local_tensor"]',
        "tests/integration/test_reshard_oracles.py::test_verl_reshard_is_the_run_as_dcp",
    ),
    Mutation(
        "inspect-counts-nonempty-chunks-only",
        "prints the producer ..., its world size (the number of distinct ranks that wrote data files), the total bytes, and every entry grouped by top-level key: FQN, global shape, dtype, number of chunks and bytes",
        "fsdp_convert/ops/inspect.py",
        "chunks=len(e.chunks),",
        "chunks=len([c for c in e.chunks if c.numel > 0]),",
        "tests/cli/test_cli.py::test_inspect_json_agrees_with_torchs_reading_of_metadata",
    ),
    Mutation(
        "inspect-bytes-entry-size-zero",
        "prints the producer ..., its world size (the number of distinct ranks that wrote data files), the total bytes, and every entry grouped by top-level key: FQN, global shape, dtype, number of chunks and bytes",
        "fsdp_convert/ops/inspect.py",
        "                    chunks_per_dim=None,\n                    nbytes=e.nbytes,",
        "                    chunks_per_dim=None,\n                    nbytes=0,",
        "tests/cli/test_cli.py::test_inspect_json_agrees_with_torchs_reading_of_metadata",
    ),
    Mutation(
        "inspect-world-size-max-rank",
        "prints the producer ..., its world size (the number of distinct ranks that wrote data files), the total bytes, and every entry grouped by top-level key: FQN, global shape, dtype, number of chunks and bytes",
        "fsdp_convert/formats/index.py",
        "return self.ranks if self.ranks is not None else len(self.writer_ranks)",
        "return self.ranks if self.ranks is not None else max(self.writer_ranks)",
        "tests/cli/test_cli.py::test_inspect_json_agrees_with_torchs_reading_of_metadata",
    ),
    Mutation(
        "mover-keeps-every-buffer",
        "Memory, within `--memory-budget` (default `256MiB`) per process: the mover threads' buffers fit in the budget, so peak memory is the interpreter + the budget, whatever the largest tensor, for any source read in place (local DCP folders, `HuggingFaceStorageWriter` shards)",
        "fsdp_convert/blocks.py",
        "        if len(self._buffers[which]) < nbytes:\n            self._buffers[which] = bytearray(max(nbytes, self.piece_bytes))\n        return memoryview(self._buffers[which])[:nbytes]",
        "        self._buffers.append(bytearray(max(nbytes, self.piece_bytes)))\n        return memoryview(self._buffers[-1])[:nbytes]",
        "tests/integration/test_memory.py::test_peak_memory_is_bounded_by_budget_whatever_the_largest_tensor[2-copy]",
    ),
    Mutation(
        "chunk-read-whole-into-one-buffer",
        "Memory, within `--memory-budget` (default `256MiB`) per process: the mover threads' buffers fit in the budget, so peak memory is the interpreter + the budget, whatever the largest tensor, for any source read in place (local DCP folders, `HuggingFaceStorageWriter` shards)",
        "fsdp_convert/move.py",
        "nbytes = min(COPY_BYTES, self.piece_bytes, end - done)",
        "nbytes = end - done",
        "tests/integration/test_memory.py::test_peak_memory_is_bounded_by_budget_whatever_the_largest_tensor[1-copy]",
    ),
    Mutation(
        "cast-block-is-the-whole-tensor",
        "Memory, within `--memory-budget` (default `256MiB`) per process: the mover threads' buffers fit in the budget, so peak memory is the interpreter + the budget, whatever the largest tensor, for any source read in place (local DCP folders, `HuggingFaceStorageWriter` shards); `--dtype` casts are assembled row block by row block",
        "fsdp_convert/move.py",
        "block_rows = max(1, self.piece_bytes // (row_elems * widest))",
        "block_rows = max(1, end - begin)",
        "tests/integration/test_memory.py::test_peak_memory_is_bounded_by_budget_whatever_the_largest_tensor[1-cast]",
    ),
    Mutation(
        "local-dcp-chunks-decoded",
        "No decode on the hot path: a DCP payload's storage record is found from its zip headers ...; peak memory is the interpreter + the budget ... for any source read in place (local DCP folders ...)",
        "fsdp_convert/formats/dcp.py",
        "if chunk.relative_path is None or chunk.transform_descriptors or not isinstance(self.root, Path):",
        "if True:",
        "tests/integration/test_memory.py::test_peak_memory_is_bounded_by_budget_whatever_the_largest_tensor[2-cast]",
    ),
    Mutation(
        "mover-buffers-ignore-the-budget",
        "Memory, within `--memory-budget` (default `256MiB`) per process: the mover threads' buffers fit in the budget, so peak memory is the interpreter + the budget, whatever the largest tensor, for any source read in place (local DCP folders, `HuggingFaceStorageWriter` shards)",
        "fsdp_convert/plan/consolidate.py",
        "max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, piece))",
        "max(MIN_PIECE_BYTES, MAX_PIECE_BYTES)",
        "tests/unit/test_plan.py::test_mover_buffers_fit_the_memory_budget",
    ),
    Mutation(
        "tp-chunks-decoded",
        "No decode on the hot path: ... chunks split on other dims (tensor parallel) and `--dtype` casts are assembled row block by row block",
        "fsdp_convert/blocks.py",
        "self.stored: StoredBytes | None = mover.reader.locate(entry, chunk)",
        "self.stored: StoredBytes | None = None",
        "tests/unit/test_move.py::test_whole_tensor_moved_undecoded[tp2d-64]",
    ),
    Mutation(
        "moved-chunk-crc-never-compared",
        "CRC-32: every zip record of every payload is checked as it is read",
        "fsdp_convert/formats/reader.py",
        "if stored.crc32 is not None and crc != stored.crc32:",
        "if False:",
        "tests/unit/test_move.py::test_corrupt_chunk_is_refused[True-dim0-offsets0-5-None-None]",
    ),
    Mutation(
        "partial-chunk-crc-not-verified",
        "CRC-32: every zip record of every payload is checked as it is read (a chunk moved only in part is read through for its CRC-32)",
        "fsdp_convert/move.py",
        "self.verify(stored)  # read in part: its stored CRC-32 covers the whole chunk",
        "pass  # read in part: its stored CRC-32 covers the whole chunk",
        "tests/unit/test_move.py::test_corrupt_chunk_is_refused[True-dim0-offsets1-37-rows1-None]",
    ),
    Mutation(
        "partial-tp-chunk-crc-not-verified",
        "CRC-32: every zip record of every payload is checked as it is read (a chunk moved only in part is read through for its CRC-32)",
        "fsdp_convert/blocks.py",
        "mover.verify(self.stored)  # read in part: its stored CRC-32 covers the whole chunk",
        "pass  # read in part: its stored CRC-32 covers the whole chunk",
        "tests/unit/test_move.py::test_corrupt_chunk_is_refused[True-tp2d-offsets4-31-rows4-None]",
    ),
    Mutation(
        "sigint-leaves-out",
        "exit 130, 143: interrupted by SIGINT (Ctrl-C) or SIGTERM before the output was complete; nothing was left at `OUT` (with a local `OUT`, the temporary is kept for `--resume`)",
        "fsdp_convert/writers/_atomic.py",
        "            if not _keep(tmp, e, keep):\n                discard()\n        raise",
        "            if not _keep(tmp, e, keep):\n                discard()\n            elif isinstance(e, KeyboardInterrupt):\n                os.replace(tmp, output)\n        raise",
        "tests/integration/test_signals.py::test_signal_mid_write_keeps_the_temporary_for_resume[2-1-130]",
    ),
    Mutation(
        "sigterm-workers-leaves-out",
        "exit 130, 143: interrupted by SIGINT (Ctrl-C) or SIGTERM before the output was complete; nothing was left at `OUT` (with a local `OUT`, the temporary is kept for `--resume`)",
        "fsdp_convert/writers/_atomic.py",
        "            if not _keep(tmp, e, keep):\n                discard()\n        raise",
        "            if not _keep(tmp, e, keep):\n                discard()\n            elif isinstance(e, TerminatedError):\n                os.replace(tmp, output)\n        raise",
        "tests/integration/test_signals.py::test_signal_mid_write_keeps_the_temporary_for_resume[15-2-143]",
    ),
    Mutation(
        "dead-worker-leaves-out",
        "Atomic: the output is written to a hidden temporary sibling and renamed into place only when complete and fsynced. `OUT` is never half-written ... a failed worker ... keeps the hidden temporary (`.OUT.tmp-local`) and its manifest",
        "fsdp_convert/writers/_atomic.py",
        "            if not _keep(tmp, e, keep):\n                discard()\n        raise",
        "            if not _keep(tmp, e, keep):\n                discard()\n            elif isinstance(e, WorkerFailedError):\n                os.replace(tmp, output)\n        raise",
        "tests/integration/test_signals.py::test_dead_worker_fails_the_job_within_seconds",
    ),
    Mutation(
        "sigkill-leaves-out",
        "A SIGKILL can leave the temporary (`.OUT.tmp-local`; `.OUT.tmp-rdzv-<id>` on many nodes, `.OUT.tmp-torchrun-<id>` under torchrun), never an `OUT`.",
        "fsdp_convert/writers/_atomic.py",
        "        try:\n            yield tmp\n        except LeaveToOwner:",
        "        output.symlink_to(tmp)  # OUT shows the temporary as it is written\n        try:\n            yield tmp\n        except LeaveToOwner:",
        "tests/integration/test_signals.py::test_sigkill_mid_write_leaves_no_output",
    ),
    Mutation(
        "dead-worker-unnoticed",
        "A worker that dies fails the job within seconds, naming its rank.",
        "fsdp_convert/_local_workers.py",
        "        ready = multiprocessing.connection.wait([*running, *pending.values()], timeout=watch.interval)",
        "        ready = multiprocessing.connection.wait([*pending.values()], timeout=watch.interval)",
        "tests/integration/test_signals.py::test_dead_worker_fails_the_job_within_seconds",
    ),
    Mutation(
        "dead-node-unnoticed",
        "if any node fails or dies, the job fails within seconds on every node and nothing is left at `OUT`.",
        "fsdp_convert/_local_workers.py",
        "        ready = multiprocessing.connection.wait([*running, *pending.values()], timeout=watch.interval)",
        "        ready = multiprocessing.connection.wait([*pending.values()], timeout=watch.interval)",
        "tests/integration/test_multinode.py::test_a_dead_node_fails_the_job",
    ),
    Mutation(
        "movers-not-stopped-by-an-error",
        "On an error ... the temporary is removed (the run stops: a mover's error stops the other movers at their next piece)",
        "fsdp_convert/blocks.py",
        "if self._stop is not None and self._stop.is_set():",
        "if False:",
        "tests/unit/test_move.py::test_move_all_raises_the_cause_not_the_stop[True]",
    ),
    Mutation(
        "error-reported-is-a-stopped-mover",
        "exit 1: conversion failed: ... CRC-32 mismatch (the error reported is the cause, not a mover it stopped)",
        "fsdp_convert/move.py",
        "raise next((e for e in errors if not isinstance(e, InterruptedError)), errors[0])",
        "raise next((e for e in errors if isinstance(e, InterruptedError)), errors[0])",
        "tests/unit/test_move.py::test_move_all_raises_the_cause_not_the_stop[True]",
    ),
    Mutation(
        "record-crc-from-first-piece",
        "only offsets and CRC-32s go to rank 0 (as JSON), which writes the headers, the pickle and the central directory last (each storage's CRC-32 combined from its pieces')",
        "fsdp_convert/pieces.py",
        "    crc = pieces_crc(parts)\n",
        "    crc = pieces_crc(parts[:1])\n",
        "tests/integration/test_consolidate.py::test_consolidate_pt_equals_ground_truth[ws3_fp32]",
    ),
    Mutation(
        "multinode-plans-one-node",
        "Run the same command on every node; the work is split over all nnodes x nproc-per-node workers by bytes (the output is what one node writes)",
        "fsdp_convert/launch.py",
        "    return cluster.nnodes * nproc",
        "    return nproc",
        "tests/integration/test_multinode.py::test_two_nodes_write_what_one_node_writes",
    ),
    Mutation(
        "torchrun-worker-plans-alone",
        "under torchrun ... -m fsdp_convert consolidate CKPT OUT each process sees RANK, WORLD_SIZE, LOCAL_RANK and runs as that worker",
        "fsdp_convert/launch.py",
        '        return int(os.environ["WORLD_SIZE"])',
        "        return 1",
        "tests/integration/test_multinode.py::test_cli_runs_as_the_workers_of_users_torchrun",
    ),
    Mutation(
        "verify-workers-drop-differences",
        "verify --nproc N compares with N workers, each opening both sides and taking every N-th key; rank 0 gathers the differences",
        "fsdp_convert/ops/verify.py",
        'diffs += [Difference(key=k, kind="differs", detail=d) for k, d in (differing or [])]',
        'diffs += [Difference(key=k, kind="differs", detail=d) for k, d in (differing or [])][:1]',
        "tests/integration/test_multinode.py::test_verify_with_two_workers_gathers_every_difference",
    ),
    Mutation(
        "torchtune-not-detected",
        "`inspect` names the producer (`producer: ...`)",
        "fsdp_convert/producers/detect.py",
        'return "model" in tops and TORCHTUNE_PROGRESS <= tops',
        "return False",
        "tests/integration/test_torchtune.py::test_inspect_names_torchtune_and_reads_output_as_its_newest_epoch",
    ),
    Mutation(
        "megatron-common-pt-not-copied",
        "`reshard` copies `common.pt` and `metadata.json` byte for byte",
        "fsdp_convert/producers/megatron.py",
        "detect = beside(COMMON_FILENAME, METADATA_FILENAME)",
        "detect = lambda index: False  # noqa: E731",
        "tests/integration/test_megatron.py::test_megatron_reshard_loads_with_dist_checkpointing_at_three_ranks",
    ),
    Mutation(
        "olmo-core-flat-optimizer-nested",
        "`consolidate` keeps a flattened optimizer as `unshard_checkpoint` writes it",
        "fsdp_convert/plan/items.py",
        "keep_layout=keep_layout or keep_flat,",
        "keep_layout=keep_layout,",
        "tests/integration/test_olmo_core.py::test_olmo_core_step_folder_is_named_and_consolidates_as_its_unshard_checkpoint",
    ),
    Mutation(
        "rename-after-adapter",
        "`--rename` applies before `--adapter`: the adapter sees the renamed FQNs",
        "fsdp_convert/transform/__init__.py",
        "entry, fqn = index.entries[i], name(slot.param)",
        "entry, fqn = index.entries[i], clean_fqn(slot.param, keep_wrapper_names=options.keep_wrapper_names)",
        "tests/unit/test_rename_adapter_order.py::test_renames_reach_the_adapter_so_every_tensor_is_mapped",
    ),
    Mutation(
        "unstack-layers-off-by-one-layer",
        "`--unstack-layers`: ... written with each layer its own tensor, `decoder.layers.<i>.<name>` of shape `(...)`",
        "fsdp_convert/transform/unstack.py",
        "inputs=(Input(fqn=entry.fqn, rows=Segment(0, rows, layer * rows), view=view),),",
        "inputs=(Input(fqn=entry.fqn, rows=Segment(0, rows, (layers - 1 - layer) * rows), view=view),),",
        "tests/integration/test_megatron_unstack.py::test_unstack_layers_consolidates_each_layer_bit_for_bit",
    ),
    Mutation(
        "deepseek-v3-mtp-layer-misnumbered",
        "`torchtitan-deepseek-v3-to-hf` and `hf-to-torchtitan-deepseek-v3` follow torchtitan 0.3.0's `DeepSeekV3StateDictAdapter`",
        "fsdp_convert/adapters/deepseek_v3.py",
        "numbers = [str(main_layers + int(numbers[0]))]",
        "numbers = [str(int(numbers[0]))]",
        "tests/integration/test_deepseek_v3.py::test_torchtitan_deepseek_v3_to_hf_and_back",
    ),
    Mutation(
        "fp8-dequantize-one-scale-row",
        "`--dequantize`: the output is bit for bit what torch's `QuantizedHuggingFaceStorageReader` (block 128, float32 target) reads",
        "fsdp_convert/transform/fp8.py",
        ".mul_(scale[:, :whole, None])",
        ".mul_(scale[:1, :whole, None])",
        "tests/integration/test_fp8_dequantize.py::test_dequantize_equals_torch_reader_and_weight_dequant",
    ),
    Mutation(
        "fp8-chain-rows-unmapped",
        "an `hf-to-torchtitan-*` adapter on a block-FP8 folder dequantizes first, bit for bit torch's `QuantizedHuggingFaceStorageReader` then torchtitan's `from_hf`",
        "fsdp_convert/transform/chain.py",
        "return self.inner(rows.start, rows.stop) if rows else range(0)",
        "return self.inner(r0, r1) if rows else range(0)",
        "tests/integration/test_fp8_adapter.py::test_hf_fp8_to_torchtitan_dequantizes_as_torch_reader_then_from_hf",
    ),
    Mutation(
        "fp8-adapter-without-implied-dequantize",
        "an `hf-to-torchtitan-*` adapter implies `--dequantize` on a block-FP8 folder",
        "fsdp_convert/adapters/__init__.py",
        "        adapter = with_fp8(bound, dequantize=True) or bound",
        "        adapter = bound",
        "tests/integration/test_fp8_adapter.py::test_hf_fp8_to_torchtitan_dequantizes_as_torch_reader_then_from_hf",
    ),
    Mutation(
        "fp8-chain-gathered-rows-as-a-run",
        "a row-permuting adapter (Q/K heads) on a block-FP8 folder equals dequantizing to a folder first",
        "fsdp_convert/transform/chain.py",
        "return [i for r in rows for i in self.inner(r, r + 1)]",
        "return list(self.inner(min(rows), min(rows) + len(rows)))",
        "tests/integration/test_fp8_adapter.py::test_head_permuted_rows_of_an_fp8_weight_equal_dequantize_first",
    ),
    Mutation(
        "fp8-quantize-after-adapter-skips-its-combine",
        "`--adapter torchtitan-deepseek-v3-to-hf --quantize fp8-block128` equals torchtitan's `to_hf` then transformers' `Fp8Quantize`, expert by expert",
        "fsdp_convert/transform/fp8.py",
        "        combine = combine.outer",
        "        pass",
        "tests/integration/test_fp8_adapter.py::test_adapter_then_quantize_equals_to_hf_then_fp8_quantize",
    ),
    Mutation(
        "gpt-oss-experts-reshaped-not-transposed",
        "`torchtitan-gpt-oss-to-transformers` writes each expert transposed, as transformers' GptOssExperts reads it, and `from_pretrained` loads the folder as written",
        "fsdp_convert/adapters/gpt_oss.py",
        "    return parts[0].transpose(1, 2)",
        "    return parts[0].reshape(parts[0].shape[0], parts[0].shape[2], parts[0].shape[1])",
        "tests/integration/test_gpt_oss.py::test_torchtitan_gpt_oss_to_transformers_and_back",
    ),
    Mutation(
        "fp8-quantize-block-without-its-head",
        "`--quantize fp8-block128`: transformers' fine-grained FP8 `Fp8Quantize`, bit for bit",
        "fsdp_convert/transform/fp8.py",
        "whole = torch.cat([head, rows, tail]).to(torch.float32)",
        "whole = torch.cat([rows, tail]).to(torch.float32)",
        "tests/integration/test_fp8_quantize.py::test_quantize_equals_transformers",
    ),
    Mutation(
        "gpt-oss-expert-bias-misnamed",
        "`torchtitan-gpt-oss-to-hf` and `hf-to-torchtitan-gpt-oss` follow torchtitan 0.3.0's `GptOssStateDictAdapter`",
        "fsdp_convert/adapters/gpt_oss.py",
        '"model.layers.{}.mlp.experts.down_proj_bias": _EXPERTS + "mlp2_bias_ED",',
        '"model.layers.{}.mlp.experts.down_proj_bias": _EXPERTS + "mlp1_bias_EG",',
        "tests/integration/test_gpt_oss.py::test_torchtitan_gpt_oss_to_hf_and_back",
    ),
    Mutation(
        "expert-copy-crc-not-verified",
        "CRC-32: every zip record of every payload is checked as it is read (a chunk moved only in part is read through for its CRC-32)",
        "fsdp_convert/move.py",
        "self.verify(stored)  # a part (an expert): the stored CRC-32 is the whole chunk's",
        "pass  # a part (an expert): the stored CRC-32 is the whole chunk's",
        "tests/unit/test_move_segments.py::test_expert_copied_from_a_corrupt_chunk_is_refused",
    ),
    Mutation(
        "expert-split-not-a-byte-copy",
        "each routed expert of a stacked weight is a byte-range copy",
        "fsdp_convert/chunk_rows.py",
        "if derived.combine is not None:",
        "if False:",
        "tests/unit/test_move_segments.py::test_segment_runs_leaves_other_derived_tensors_to_move_derived",
    ),
    # --- issue 37: hostile input, round four (tests/redteam/) ---
    Mutation(
        "workers-import-from-cwd",
        "docs/safety.md: workers started by `--nproc` never import from the current folder",
        "fsdp_convert/syspath.py",
        '    os.environ["PYTHONSAFEPATH"] = "1"\n',
        '    os.environ.get("PYTHONSAFEPATH")\n',
        "tests/redteam/test_workers.py::test_a_console_script_run_in_the_checkpoint_folder_imports_nothing_from_it",
    ),
    Mutation(
        "adapter-folder-on-sys-path",
        "docs/safety.md: `--adapter module:function` loads only that module from the current folder; the folder never goes on `sys.path`",
        "fsdp_convert/adapters/user.py",
        '            import_file_module(top, folder / f"{top}.py")\n',
        "            sys.path.append(str(folder))\n",
        "tests/redteam/test_workers.py::test_an_adapter_from_the_current_folder_leaves_no_other_module_importable_from_it",
    ),
    Mutation(
        "stalled-worker-silent",
        "docs/safety.md: a worker that uses no CPU for `FSDP_CONVERT_STALL_SECONDS` is named once on stderr with its rank and pid",
        "fsdp_convert/_local_workers.py",
        "        watch.check(running.values())",
        "        pass",
        "tests/redteam/test_workers.py::test_a_stopped_worker_is_named_once_by_rank_and_pid_and_the_run_goes_on",
    ),
    Mutation(
        "walk-follows-folder-links",
        "docs/safety.md: files are opened by a walk from the folder's held descriptor with `O_NOFOLLOW` on every component",
        "fsdp_convert/held_roots.py",
        "_FOLDER = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY",
        "_FOLDER = os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY",
        "tests/redteam/test_reads_race.py::test_a_folder_swapped_for_a_link_between_two_opens_is_refused",
    ),
    Mutation(
        "overwrite-replaces-device",
        "docs/safety.md: OUT is replaced only when it is a regular file or a folder; a device, FIFO or socket is refused",
        "fsdp_convert/writers/_output_check.py",
        "    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):",
        "    if False:",
        "tests/redteam/test_output_replace.py::test_overwrite_refuses_a_device_fifo_or_socket_at_out",
    ),
    Mutation(
        "replaced-temporary-published",
        "docs/safety.md: a run renames its temporary only while the name still holds the file it created",
        "fsdp_convert/writers/_atomic.py",
        "        if not _still_held(tmp, held, dir_fd):\n            raise _replaced(output, tmp)",
        "        if False:\n            raise _replaced(output, tmp)",
        "tests/redteam/test_output_replace.py::test_a_temporary_swapped_in_process_is_not_published",
    ),
    Mutation(
        "out-takes-run-name",
        "docs/safety.md: an OUT named like the tool's own lock, temporary, manifest or staging files is refused",
        "fsdp_convert/writers/_output_check.py",
        "    taken = run_name(out)",
        "    taken = None",
        "tests/redteam/test_output_replace.py::test_out_may_not_name_a_runs_lock_temporary_or_manifest",
    ),
    Mutation(
        "mount-point-replaced",
        "docs/safety.md: a mount point at OUT is refused (exit 4)",
        "fsdp_convert/writers/_output_check.py",
        "    if _mount_point(output):",
        "    if False:",
        "tests/redteam/test_output_replace.py::test_overwrite_force_refuses_a_mount_point",
    ),
    Mutation(
        "plain-walk-not-memoized",
        "docs/safety.md: plain values are walked each object once (`x = [x, x]` forty times over costs time linear in its bytes)",
        "fsdp_convert/formats/_paths.py",
        "if id(value) not in known:",
        "if True:",
        "tests/redteam/test_values.py::test_shared_references_in_a_pt_consolidate_fast_and_faithfully",
    ),
    Mutation(
        "self-reference-not-detected",
        "docs/safety.md: a value that contains itself is refused in one line",
        "fsdp_convert/formats/_plain.py",
        "if id(child) in on_path:",
        "if False:",
        "tests/redteam/test_values.py::test_pt_value_that_holds_itself_refused_in_one_line",
    ),
    Mutation(
        "plain-nan-by-value",
        "docs/safety.md: `verify` compares plain floats by their bits: NaN equals itself",
        "fsdp_convert/formats/_plain.py",
        "return (float, _pack_double(value))",
        "return (float, value)",
        "tests/redteam/test_values.py::test_nan_in_plain_values_compares_equal",
    ),
    Mutation(
        "value-tensor-pickled-by-reduce",
        "docs/safety.md: a tensor inside a plain value is written as torch.save writes it (`weights_only=True` reads it)",
        "fsdp_convert/writers/_torch_pickle.py",
        "        return self._torch_storage_id(obj)",
        "        return None",
        "tests/redteam/test_written_values.py::test_tuple_of_tensors_in_a_pt_loads_weights_only",
    ),
    Mutation(
        "reshard-writes-unreadable-keys",
        "docs/safety.md: `reshard` refuses a key its own reader would refuse, before writing anything",
        "fsdp_convert/outputs/dcp_folder.py",
        "if not readable_name(key) or not readable_path(plain_path(path)):",
        "if False:",
        "tests/redteam/test_reshard_keys.py::test_reshard_refuses_a_key_its_reader_refuses",
    ),
    Mutation(
        "empty-split-unbounded",
        "docs/safety.md: no split makes more pieces than max(1024, the tensor's bytes)",
        "fsdp_convert/transform/unstack.py",
        "if pieces > max(MAX_EMPTY_SPLIT, nbytes):",
        "if False:",
        "tests/redteam/test_claimed_shapes.py::test_check_split_bound",
    ),
    Mutation(
        "leak-header-length",
        "docs/safety.md: error lines never quote bytes or numbers read from a data file",
        "fsdp_convert/formats/_dcp_payloads.py",
        'has a length that does not fit the file ({file_size} bytes)"',
        'has length {n}, which does not fit the file ({file_size} bytes)"',
        "tests/redteam/test_messages.py::test_inspect_of_the_rows_checkpoint_quotes_no_length",
    ),
    Mutation(
        "unbounded-manifest",
        "docs/safety.md: `--resume` reads the temporary's own files only if they are no larger than the plan can have written",
        "fsdp_convert/writers/_readback.py",
        "return _MANIFEST_BASE_BYTES + _MANIFEST_BYTES_PER_FILE * files",
        "return 1 << 40",
        "tests/redteam/test_resume_files.py::test_a_huge_sparse_file_in_the_manifest_folder_is_refused_unread",
    ),
    Mutation(
        "raw-names-in-verify",
        "docs/safety.md: in text output, control characters in names are shown escaped",
        "fsdp_convert/cli/verify_cmd.py",
        "table.add_row(*(Text(escape_controls(cell)) for cell in (d.key, d.kind, d.detail)))",
        "table.add_row(*(Text(cell) for cell in (d.key, d.kind, d.detail)))",
        "tests/redteam/test_messages.py::test_verify_shows_escaped_names_and_json_keeps_them",
    ),
    # --- one home for each fact: the tables decide (docs/architecture.md) ---
    Mutation(
        "own-files-without-producers",
        "docs/architecture.md: `--overwrite` replaces, without `--force`, a folder holding every output row's files and every producer's copied side files",
        "fsdp_convert/producers/__init__.py",
        'files = [DCP_FILE_RE, *(s.pattern for p in PRODUCERS for s in p.side_files if s.action == "copy")]',
        "files = [DCP_FILE_RE]",
        "tests/integration/test_reshard_overwrite_own.py::test_reshard_overwrite_onto_its_own_output_needs_no_force[megatron-core]",
    ),
    # --- DeepSpeed ZeRO (docs/producers.md "DeepSpeed ZeRO") ---
    Mutation(
        "zero3-share-floored",
        "docs/producers.md: consolidate of a DeepSpeed save writes the fp32 master weights, what zero_to_fp32 returns, bit for bit",
        "fsdp_convert/formats/_flat_ranges.py",
        "part = -(-numel // ws)",
        "part = numel // ws",
        "tests/integration/test_deepspeed.py::test_consolidate_pt_equals_the_runs_state[z3-3]",
    ),
    Mutation(
        "zero12-alignment-padding-ignored",
        "docs/producers.md: ZeRO-1/2 with parameter_alignment consolidates bit for bit (padding between parameters left out)",
        "fsdp_convert/formats/_flat_ranges.py",
        "offset += numel + pad",
        "offset += numel",
        "tests/integration/test_deepspeed.py::test_consolidate_pt_equals_the_runs_state[z2a-3]",
    ),
    Mutation(
        "zero-layout-without-nccl-alignment",
        "docs/producers.md: reshard writes the partitions and paddings an engine at M ranks builds",
        "fsdp_convert/plan/deepspeed.py",
        "align = _NCCL_START_ALIGNMENT_FACTOR * world_size",
        "align = world_size",
        "tests/unit/test_deepspeed_layout.py::test_layout_for_another_world_size_is_what_deepspeed_saves[z2-2-3]",
    ),
    Mutation(
        "format-names-not-from-the-table",
        "docs/architecture.md: the `--format` name of a new output row is taken and listed by the CLI from the table",
        "fsdp_convert/output_table.py",
        'return tuple(dict.fromkeys(("auto", *(row.format for row in OUTPUT_ROWS if row.format is not None))))',
        'return ("auto", "torch", "safetensors")',
        "tests/unit/test_output_kind_extension.py::test_a_folder_kind_with_its_own_format_name",
    ),
    Mutation(
        "matched-payload-crc-not-checked",
        "CRC-32: every zip record of every payload is checked as it is read (a payload matched against one of its shape)",
        "fsdp_convert/formats/_payload_shapes.py",
        "if check_crc and any(crc32(read(n, o)) != _U32.unpack(read(4, c))[0] for o, n, c in shape.checked):",
        "if False:",
        "tests/unit/test_payload_shapes.py::test_any_byte_changed_gives_the_full_parses_answer[True]",
    ),
    Mutation(
        "matched-payload-compared-in-part",
        "a chunk payload parsed once per shape; payloads of that shape matched against its bytes",
        "fsdp_convert/formats/_payload_shapes.py",
        "if any(whole[at:end] != span for at, end, span in shape.fixed):",
        "if any(whole[at:end] != span for at, end, span in shape.fixed[:1]):",
        "tests/unit/test_payload_shapes.py::test_any_byte_changed_gives_the_full_parses_answer[False]",
    ),
    Mutation(
        "emptied-state-used-elsewhere",
        "a state dict that anything else uses (an empty state given to a record or call, a reference to an emptied one left after the load) sends the file to the interpreter",
        "fsdp_convert/formats/_child_records.py",
        "return max(map(sys.getrefcount, CLEARED), default=0) <= 3",
        "return True",
        "tests/unit/test_metadata_child.py::test_a_state_the_child_empties_used_elsewhere_is_left_to_the_interpreter",
    ),
    Mutation(
        "every-worker-gets-the-whole-job",
        "each receives, in its own pickled job (`_local_workers.run_local`), the part of the index it needs",
        "fsdp_convert/_local_workers.py",
        "return [for_rank(rank) for rank in range(nproc)] if callable(for_rank) else [job] * nproc",
        "return [job] * nproc",
        "tests/unit/test_local_workers.py::test_gather_barrier_and_counters_span_three_workers",
    ),
]


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree but still tracked
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _apply(tree: Path, m: Mutation) -> None:
    path = tree / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"{m.name}: {m.file} holds the text to replace {count} times, not once: {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def _run_test(tree: Path, test: str, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    python = ROOT / ".venv" / "bin" / "python"
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [str(python if python.exists() else sys.executable), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - start, "timed out"
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, time.monotonic() - start, tail[-1] if tail else ""


def run(m: Mutation, *, baseline: bool, timeout: float) -> bool:
    """Apply ``m`` in a fresh copy and run its test; True when the test fails (the mutation is caught)."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{m.name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if baseline:
            code, seconds, last = _run_test(tree, m.test, timeout)
            if code != 0:
                print(f"  {m.name}: the test fails WITHOUT the mutation ({last}); fix the test first", flush=True)
                return False
        _apply(tree, m)
        code, seconds, last = _run_test(tree, m.test, timeout)
    caught = code != 0
    print(f"  {'caught ' if caught else 'MISSED '} {m.name:<40} {seconds:6.0f} s  {last}", flush=True)
    return caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true", help="check that every edit applies exactly once; run no test")
    parser.add_argument("--baseline", action="store_true", help="first check each test passes unmutated")
    parser.add_argument("--try", dest="adhoc", nargs=4, metavar=("FILE", "OLD", "NEW", "TEST"), help="an ad-hoc mutation")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per test run (default 900)")
    args = parser.parse_args()

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:<40} {m.test}\n    claim: {m.claim}\n    {m.file}: {m.old!r} -> {m.new!r}")
        return 0
    if args.check:
        stale = [
            f"{m.name}: {m.file} holds the text {(ROOT / m.file).read_text().count(m.old) if (ROOT / m.file).is_file() else 'no file, so'} times"
            for m in MUTATIONS
            if not (ROOT / m.file).is_file() or (ROOT / m.file).read_text().count(m.old) != 1
        ]
        stale += [
            f"{m.name}: no test file {m.test.split('::')[0]}" for m in MUTATIONS if not (ROOT / m.test.split("::")[0]).is_file()
        ]
        print("\n".join(stale) or f"all {len(MUTATIONS)} mutations apply and name an existing test file")
        return 1 if stale else 0
    if args.adhoc:
        file, old, new, test = args.adhoc
        chosen = [Mutation("adhoc", "ad hoc", file, old, new, test)]
    else:
        known = {m.name: m for m in MUTATIONS}
        unknown = [n for n in args.names if n not in known]
        if unknown:
            raise SystemExit(f"unknown mutation(s): {', '.join(unknown)} (see --list)")
        chosen = [known[n] for n in args.names] if args.names else MUTATIONS
    results = [(m, run(m, baseline=args.baseline, timeout=args.timeout)) for m in chosen]
    print()
    print("| mutation | claim | test | caught |")
    print("|---|---|---|---|")
    for m, caught in results:
        print(f"| {m.name} | {m.claim} | `{m.test}` | {'yes' if caught else '**no**'} |")
    return 0 if all(caught for _, caught in results) else 1


if __name__ == "__main__":
    sys.exit(main())
