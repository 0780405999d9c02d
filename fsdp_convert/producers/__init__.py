"""Producers stage: which training stack wrote a checkpoint, and what that means to each operation.

One record per producer (``record.Producer``) in one ordered table, ``PRODUCERS``: how it is
detected, its optimizer key, the files beside its DCP data (copied by ``reshard``, left out with a
note, merged at the top level by ``consolidate``), its folder layout, its own key layout, and the
loader that reads each output. The two tables of ``docs/producers.md`` are rendered from the
records (``producers.tables``; a test keeps them equal). ``inspect`` prints
``detect_producer(index).name``; ``plan.items``, ``reshard`` and the output check (``own_files``) read
the records. Adding a producer is one record here, its ``detect`` built from the facts a format
records (``producers.detect.beside(marker)``: a file beside ``.metadata``); one whose rules need
code of their own gets a module here too, as ``producers/megatron.py`` (and ``formats/`` only when
its files need a new way of being read).

A format records facts and names no producer (``CheckpointIndex.folders``, ``beside``, ``marks``);
the records' ``detect`` functions alone decide the name. Functions over a ``CheckpointIndex``; no
file's contents are read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.formats.dcp import ACCELERATE_DIR_RE, DCP_FILE_RE, OLMO_CORE_DIRNAME
from fsdp_convert.formats.deepspeed_files import OWN_FILES as DEEPSPEED_FILES
from fsdp_convert.formats.index import CheckpointIndex, ObjPath
from fsdp_convert.held_roots import inside
from fsdp_convert.own_files import OwnFiles
from fsdp_convert.producers import megatron
from fsdp_convert.producers.detect import (
    LIGHTNING_META_FILENAME,
    OLMO_CORE_METADATA_FILENAME,
    accelerate,
    any_dcp,
    by_keys,
    deepspeed,
    fsdp1,
    fsdp1_rank_files,
    hf_storage,
    lightning,
    olmo_core,
    safetensors,
    torch_save,
    torchtitan,
    torchtune,
    verl,
)
from fsdp_convert.producers.record import Producer, SideFile
from fsdp_convert.roles import EntryRole, EntryRule
from fsdp_convert.roles import classify as classify_with

__all__ = [
    "ACCELERATE_SHARED_RE",
    "PRODUCERS",
    "Beside",
    "Producer",
    "SideFile",
    "check_optimizer",
    "classify",
    "detect_producer",
    "entry_rules",
    "get",
    "merged_files",
    "optimizer_path",
    "own_files",
    "sort_beside",
]

# what reshard says of a file beside the DCP data that no producer names
UNKNOWN_NOTE = "not part of the checkpoint as this tool knows it; copy them if they apply"
# accelerate's save_state files that hold the same at any world size (written by the main process only: LR
# schedulers, samplers, the grad scaler, register_for_checkpointing's objects), which reshard copies beside
ACCELERATE_SHARED_RE = re.compile(r"(scheduler|sampler)(_\d+)?\.bin|scaler\.pt|custom_checkpoint_\d+\.pkl")

_AS_FSDP2 = "as `fsdp2`"
_FSDP_CONSOLIDATE = '`{"model", "optim"}`: `model.load_state_dict`; `--optim-keys ids` for a plain `optim.load_state_dict`'
_DCP_LOAD = "`dcp.load` (a regular DCP folder)"
_OLMO_TRAIN_NOTE = (
    "OLMo-core's per-rank trainer state (step, data loader, RNG; pickles, never loaded) belongs to the old ranks: "
    "Checkpointer.load then loads model and optimizer only; copy train/rank0.pt over to resume the step count"
)

PRODUCERS: tuple[Producer, ...] = (
    Producer(
        name="fsdp2",
        detect=by_keys("fsdp2"),
        by_keys=True,
        label="`fsdp2`",
        tested="torch 2.13.0 `fully_shard` + `dcp.save`",
        on_disk='DCP of `get_state_dict`: `{"model", "optim"}`',
        notes="optimizer state keyed by FQN",
        consolidate_loader=_FSDP_CONSOLIDATE,
        reshard_loader="`dcp.load` of `get_state_dict` at M ranks",
    ),
    Producer(
        name="fsdp1",
        detect=fsdp1,
        by_keys=True,
        params_in_model_order=True,
        label="`fsdp1`",
        tested="torch 2.13.0 `FullyShardedDataParallel` + `dcp.save`",
        on_disk="DCP of `SHARDED_STATE_DICT` + `FSDP.optim_state_dict`, `use_orig_params` true or false",
        notes="told from FSDP2 by the empty chunks FSDP2 records for tensors smaller than the world size "
        "(`fsdp` when no tensor tells)",
        consolidate_loader=_FSDP_CONSOLIDATE,
        reshard_loader="`dcp.load` of `get_state_dict` at M ranks",
    ),
    Producer(
        name="torchtitan",
        detect=torchtitan,
        by_keys=True,
        optimizer_key="optimizer",
        label="`torchtitan`",
        tested="torchtitan 0.3.0",
        on_disk="DCP with model weights at the top level beside `optimizer` (flattened: `state.<fqn>.<name>`, "
        "`param_groups.<fqn>.<field>`), `lr_scheduler`, `train_state`, `dataloader`, under `checkpoint/step-N/`",
        notes="param groups are rebuilt from the per-parameter copies; the parent folder answers with the `step-N/` "
        "to pass; llama3's fused `wqkv` is saved as `wq`/`wk`/`wv` in the model but as `wqkv` in the optimizer "
        "state, and both stay as saved",
        consolidate_loader='`{"model", "optimizer", "lr_scheduler", ...}`: its llama3 model\'s `load_state_dict`, '
        "`--optim-keys ids` for `AdamW.load_state_dict` (torchtitan itself reads DCP or HF, not a `.pt`)",
        reshard_loader="its `CheckpointManager.load()` at M ranks",
    ),
    Producer(
        name="accelerate",
        detect=accelerate,
        optimizer_key="optimizer",
        side_files=(
            # written by the main process only, the same at any world size: LR schedulers, samplers, the
            # grad scaler, register_for_checkpointing's objects
            SideFile(pattern=ACCELERATE_SHARED_RE, action="copy"),
            SideFile(
                pattern=re.compile(r"random_states_\d+\.pkl"),
                action="leave_out",
                note="accelerate's per-rank RNG states (pickles, never loaded) belong to the old ranks; load_state "
                "then keeps each rank's current RNG state and accelerator.step, which they also hold",
            ),
        ),
        folders=ACCELERATE_DIR_RE,
        label="`accelerate`",
        tested="accelerate 1.15",
        on_disk="`save_state`'s folder: `pytorch_model_fsdp_0/` + `optimizer_0/`, two DCP folders, and `random_states_<r>.pkl`",
        notes="pass the parent folder; the pickles are never loaded. `reshard` writes both folders for M ranks, copies "
        "`scheduler*.bin`, `sampler*.bin`, `scaler.pt` and `custom_checkpoint_*.pkl` byte for byte, and leaves out "
        "`random_states_<r>.pkl` (the old ranks' RNG states and `accelerator.step`), saying so on stderr and in `--json`",
        consolidate_loader='`{"model", "optimizer"}`: `load_state_dict` of each part (accelerate\'s `load_state` reads '
        "a full save as separate files, not this one)",
        reshard_loader="`Accelerator.load_state(OUT)` at M ranks",
    ),
    Producer(
        name="lightning",
        detect=lightning,
        optimizer_key="optimizer",
        side_files=(SideFile(pattern=re.compile(re.escape(LIGHTNING_META_FILENAME)), action="copy"),),
        merged=LIGHTNING_META_FILENAME,
        label="`lightning`",
        tested="Lightning 2.6",
        on_disk="DCP with `meta.pt` beside `.metadata`",
        notes="`consolidate` merges `meta.pt`'s entries at the top level, as Lightning does (read with "
        "`weights_only=True`); `reshard` copies it byte for byte",
        consolidate_loader='`{"model", "optimizer", "step"}`: `fabric.load` in one process, or under Fabric\'s '
        "FSDP1/FSDP2 strategies at any world size",
        reshard_loader="`fabric.load(OUT, ...)` at M ranks (FSDP1 and FSDP2)",
    ),
    Producer(
        name="torchtune",
        detect=torchtune,
        by_keys=True,
        optimizer_key="optimizer",
        label="`torchtune`",
        tested="torchtune 0.6.1",
        on_disk="`DistributedCheckpointer`'s `output/dist_epoch_<n>/` (async, one file per entry): `model.<fqn>`, "
        "`optimizer.state.<id>.<name>` and `optimizer.param_groups`, `seed`, `epochs_run`, `total_epochs`, "
        "`max_steps_per_epoch`, `dataloader`",
        notes="the optimizer is `optimizer.state_dict()` of the FSDP2 model: keyed by integer id (the model's "
        "`parameters()` order), each group's `params` a list of ids, and it stays id-keyed; `output/` is read as its "
        "newest `dist_epoch_<n>/`, the one torchtune resumes from",
        consolidate_loader='`{"model", "optimizer", "seed", "epochs_run", ...}`: `model.load_state_dict` and '
        "`optimizer.load_state_dict` of a plain model",
        reshard_loader="its `CheckpointClient.load_distributed_checkpoint` at M ranks, OUT being `<output_dir>/dist_epoch_<n>`",
    ),
    Producer(
        name="olmo-core",
        detect=olmo_core,
        flat_optimizer=True,
        side_files=(
            SideFile(pattern=re.compile(r"config\.json|" + re.escape(OLMO_CORE_METADATA_FILENAME)), action="copy"),
            SideFile(pattern=re.compile("train"), action="leave_out", note=_OLMO_TRAIN_NOTE),
        ),
        folders=re.compile(OLMO_CORE_DIRNAME),
        label="`olmo-core`",
        tested="ai2-olmo-core 3.0.0",
        on_disk="OLMo-core's `stepN/`: `model_and_optim/` (DCP: `model.<fqn>`, `optim` flattened as `state.<fqn>.<name>` / "
        "`param_groups.<fqn>.<field>`, or nested), `train/rank<r>.pt`, `config.json`, `.metadata.json`",
        notes="pass `stepN/` or its `model_and_optim/`; `consolidate` keeps a flattened optimizer as `unshard_checkpoint` "
        'writes it (`--layout nested`: `{"state", "param_groups"}`); `reshard` copies `config.json` and `.metadata.json` '
        "and leaves out `train/` (per-rank trainer state, never loaded)",
        consolidate_loader='`{"model", "optim"}`: `unshard_checkpoint`\'s `model.pt` and `optim.pt` in one file',
        reshard_loader="its `Checkpointer.load(OUT, ...)` and `load_model_and_optim_state(OUT/model_and_optim, ...)` at M ranks",
    ),
    Producer(
        name="megatron-core",
        detect=megatron.detect,
        optimizer_key="optimizer",
        side_files=(
            SideFile(pattern=re.compile(re.escape(megatron.COMMON_FILENAME)), action="copy"),
            SideFile(pattern=re.compile(re.escape(megatron.METADATA_FILENAME)), action="copy"),
        ),
        merged=megatron.COMMON_FILENAME,
        stacked_layers="decoder.layers.",
        entry_role=megatron.entry_role,
        optimizer_path=megatron.optimizer_path,
        check_optimizer=megatron.check_optimizer,
        label="`megatron-core`",
        tested="megatron-core 0.16.1",
        on_disk='`dist_checkpointing.save(..., ("torch_dist", 1))`: DCP keyed by its sharded keys (`embedding.*`, '
        "`decoder.layers.*` stacked on a leading layer dim, `output_layer.weight`), optimizer state as "
        "`optimizer.state.<name>.<key>`, beside `common.pt` (`param_groups`, step, iteration) and `metadata.json`",
        notes="checked with Megatron-Core 0.16.1 (`FP32Optimizer`'s per-parameter state; the distributed optimizer's "
        "`fully_reshardable` and `fully_sharded_model_space` write the same keys, `dp_reshardable`'s flattened buckets "
        "are refused); `consolidate` merges `common.pt` (read with `weights_only=True`) into the optimizer (its 0-dim "
        "`common_step` written as that tensor), layers stay stacked (`--unstack-layers`: "
        "`decoder.layers.<i>.<name>`, optimizer state alike); `reshard` copies `common.pt` and `metadata.json` byte "
        "for byte",
        consolidate_loader='`{"model", "optimizer": {"state", "param_groups"}, "iteration", ...}`, keyed by the '
        "sharded keys (`--adapter megatron-gpt-to-hf` for HF's per-layer names)",
        reshard_loader="`dist_checkpointing.load` at M ranks (checked at TP=1)",
    ),
    Producer(
        name="hf_storage",
        detect=hf_storage,
        label="`hf_storage`",
        tested="torch 2.13.0 `HuggingFaceStorageWriter`",
        on_disk="torch's `HuggingFaceStorageWriter`: per-rank safetensors shards, offsets in each header's "
        "`DCP_SHARDING_INFO`, no `.metadata`",
        notes="only headers are read to index",
        consolidate_loader=_AS_FSDP2,
        reshard_loader=_DCP_LOAD,
    ),
    Producer(
        name="deepspeed",
        detect=deepspeed,
        written=DEEPSPEED_FILES,
        label="`deepspeed`",
        tested="deepspeed 0.19.8 (ZeRO-1, 2, 3 and BF16_Optimizer; fp32 and bf16)",
        on_disk="`latest` and `<tag>/`: `mp_rank_00_model_states.pt` (ZeRO-3: one per rank) and "
        "`[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: flat fp32 partitions per data-parallel rank",
        notes="pass the folder with `latest` or the tag folder; the model is the fp32 master weights with buffers and "
        "frozen parameters as the module holds them, the optimizer state per parameter name; DeepSpeed's classes "
        "are read as inert records; tensor or pipeline parallelism (mp_rank_01, layer files) is refused",
        consolidate_loader='`{"model", "optim"}`: `model.load_state_dict` (what `zero_to_fp32` returns, and the optimizer)',
        reshard_loader="DeepSpeed's own `engine.load_checkpoint(OUT)` at M ranks (the same stage and dtype); "
        "`--format dcp`: FSDP2's `dcp.load` + `set_state_dict` at M ranks",
    ),
    Producer(
        name="verl",
        detect=verl,
        label="`verl`",
        tested="an imitation of verl's file names and contents (torch 2.13.0)",
        on_disk="per-rank `torch.save`: `model_world_size_N_rank_r.pt` (DTensors), `optim_...` (id-keyed), `extra_state_...`",
        notes="not DCP; indexed from the DTensors' placements, no process group needed",
        consolidate_loader=_AS_FSDP2,
        reshard_loader=_DCP_LOAD,
    ),
    Producer(
        name="fsdp1",
        detect=fsdp1_rank_files,
        params_in_model_order=True,
        label="`fsdp1` (rank files)",
        tested="torch 2.13.0 `FullyShardedDataParallel` (`SHARDED_STATE_DICT`)",
        on_disk="`SHARDED_STATE_DICT` saved rank by rank with `torch.save` (`ShardedTensor` values), `*_rank_<r>.pt`",
        notes="indexed from `ShardMetadata`",
        consolidate_loader=_AS_FSDP2,
        reshard_loader=_DCP_LOAD,
    ),
    # Named but in no table row: a producer the layout cannot tell, per-rank files of neither
    # verl nor FSDP1, a safetensors file, any other DCP checkpoint.
    Producer(
        name="fsdp",
        detect=by_keys("fsdp"),
        by_keys=True,
        params_in_model_order=True,
        label="`fsdp` (FSDP1 or FSDP2: the same layout)",  # no tensor small enough to tell them apart
    ),
    Producer(name="torch_save", detect=torch_save),
    Producer(name="safetensors", detect=safetensors),
    Producer(name="dcp", detect=any_dcp, by_keys=True),
)


def get(name: str) -> Producer:
    """The first record named ``name``.

    Raises:
        KeyError: no producer has that name.
    """
    for producer in PRODUCERS:
        if producer.name == name:
            return producer
    raise KeyError(name)


def merged_files() -> tuple[str, ...]:
    """Every record's ``merged`` file name, once each, in table order (a remote checkpoint's are looked for)."""
    return tuple(dict.fromkeys(p.merged for p in PRODUCERS if p.merged is not None))


def detect_producer(index: CheckpointIndex) -> Producer:
    """The training stack that wrote the checkpoint: the first record of ``PRODUCERS`` that detects it.

    Files first, from the facts the format recorded: accelerate's ``pytorch_model_fsdp_0/`` +
    ``optimizer_0/``, Lightning's ``meta.pt``, OLMo-core's ``model_and_optim/``, Megatron-Core's
    ``common.pt`` + ``metadata.json``, ``HuggingFaceStorageWriter``'s shards, verl's and FSDP1's rank
    files. Then keys (``Producer.by_keys``): ``fsdp1`` for FSDP1 wrapper names
    (``_fsdp_wrapped_module``, ``_flat_param``); ``torchtitan`` for model weights at the top level
    beside ``optimizer``/``train_state``; ``fsdp2`` or ``fsdp1`` for the ``{"model", "optim"}``
    layout with FQN-keyed optimizer state (FSDP2 ``get_state_dict``, FSDP1 ``SHARDED_STATE_DICT`` +
    ``FSDP.optim_state_dict``), told apart by the empty chunks FSDP2 records for small tensors;
    ``fsdp`` when no tensor is small enough to tell; ``dcp`` for any other checkpoint.

    Raises:
        UnsafeContentError: the producer's ``merged`` file is a symbolic link out of the folder
            (``CheckpointIndex.links_out``): it is read and copied later, and refused now.
    """
    by_files = (p for p in PRODUCERS if not p.by_keys and p.detect(index))
    producer = next(by_files, None) or next(p for p in PRODUCERS if p.by_keys and p.detect(index))  # dcp takes any
    root = index.checkpoint_id
    if producer.merged in index.links_out and isinstance(root, Path):
        inside(root, root / producer.merged)  # its own message (the setting as the index was read: not following)
    return producer


def entry_rules() -> tuple[EntryRule, ...]:
    """Every record's own key layout (``Producer.entry_role``), in table order: the rules ``roles.classify`` asks first."""
    return tuple(dict.fromkeys(p.entry_role for p in PRODUCERS if p.entry_role is not None))


def classify(index: CheckpointIndex) -> tuple[EntryRole, ...]:
    """The ``roles.EntryRole`` of every entry of ``index``: ``roles.classify`` with every record's key layout."""
    return classify_with(index, entry_rules())


def optimizer_path(entry_path: ObjPath, path: ObjPath, keep_layout: bool) -> ObjPath | None:
    """Where an optimizer item goes by the first record that places it (``Producer.optimizer_path``); None: as built."""
    for producer in PRODUCERS:
        placed = None if producer.optimizer_path is None else producer.optimizer_path(entry_path, path, keep_layout)
        if placed is not None:
            return placed
    return None


def check_optimizer(index: CheckpointIndex) -> None:
    """Every record's ``check_optimizer``, before a consolidation with the optimizer reads anything.

    Raises:
        UnsupportedTransformError: optimizer state that cannot be put per parameter (Megatron's
            ``dp_reshardable`` buckets).
    """
    for check in dict.fromkeys(p.check_optimizer for p in PRODUCERS if p.check_optimizer is not None):
        check(index)


def own_files() -> OwnFiles:
    """The names ``reshard`` writes in an output for the producers of ``PRODUCERS``, read from the table when called.

    Each DCP folder's ``.metadata`` and ``__<r>_<n>.distcp`` files, at the top level and in a
    record's ``folders`` (holding those alone); every ``side_files`` pattern it copies; every
    ``merged`` file; each record's ``written`` names. The output check (``writers.check_output``)
    takes them with the output kinds', so ``--overwrite`` replaces the tool's own earlier output.
    """
    files = [DCP_FILE_RE, *(s.pattern for p in PRODUCERS for s in p.side_files if s.action == "copy")]
    files += [re.compile(re.escape(p.merged)) for p in PRODUCERS if p.merged is not None]
    files += [f for p in PRODUCERS for f in p.written.files]
    folders = [(p.folders, DCP_FILE_RE) for p in PRODUCERS if p.folders is not None]
    folders += [f for p in PRODUCERS for f in p.written.folders]
    return OwnFiles(files=tuple(dict.fromkeys(files)), folders=tuple(dict.fromkeys(folders)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Beside:
    """The files beside a checkpoint's DCP data, as ``reshard`` treats them.

    Attributes:
        copied: names copied byte for byte, never loaded.
        left_out: names not carried over (a folder's with a trailing ``/``).
        notes: one line per kind of file left out, saying why.
    """

    copied: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def sort_beside(producer: Producer, entries: Iterable[tuple[str, bool, bool]]) -> Beside:
    """Sort the files beside a checkpoint's DCP data by ``producer.side_files``: copied, left out with its note, unknown.

    Args:
        producer: the checkpoint's producer.
        entries: (name, is a file, is a folder) of each entry of the checkpoint's folder that is
            neither ``.metadata``, a data file, one of its DCP folders nor hidden, in order.

    Returns:
        Copied files, then what is left out: each ``leave_out`` kind in ``side_files`` order, then
        unknown entries, with a note per kind (``left out <names>: <why>``).
    """
    copied: list[str] = []
    kinds: dict[SideFile | None, list[str]] = {s: [] for s in producer.side_files if s.action == "leave_out"}
    kinds[None] = []
    for name, is_file, is_dir in entries:
        side = producer.side_file(name)
        if side is not None and side.action == "copy" and is_file:
            copied.append(name)
        elif side is not None and side.action == "leave_out":
            kinds[side].append(name)
        else:
            kinds[None].append(name + "/" if is_dir else name)
    notes = tuple(f"left out {', '.join(n)}: {UNKNOWN_NOTE if side is None else side.note}" for side, n in kinds.items() if n)
    return Beside(copied=tuple(copied), left_out=tuple(x for n in kinds.values() for x in n), notes=notes)
