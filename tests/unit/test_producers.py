"""Producers: detection, the table's records, and the docs' tables generated from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fsdp_convert import producers, roles
from fsdp_convert.errors import UnsafeContentError, UnsupportedTransformError
from fsdp_convert.formats import read_index
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex
from fsdp_convert.producers import PRODUCERS, detect_producer, tables
from fsdp_convert.roles import OPTIM_TOPS
from tests._samples import Sample

DOCS = Path(__file__).resolve().parents[2] / "docs" / "producers.md"


def test_detects_fsdp2(ws3_ckpt: Sample) -> None:
    assert detect_producer(read_index(ws3_ckpt.checkpoint)).name == "fsdp2"


def test_docs_producer_tables_are_the_ones_the_table_renders() -> None:
    text = DOCS.read_text()
    assert tables.render_producer_table() in text, "docs/producers.md: paste tables.render_producer_table()"
    assert tables.render_loader_table() in text, "docs/producers.md: paste tables.render_loader_table()"


def test_docs_rows_name_every_producer_with_a_row() -> None:
    rows = tables.render_producer_table().splitlines()[2:]
    labels = [p.label for p in PRODUCERS if p.on_disk]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows[: len(labels)]] == labels
    assert {"fsdp2", "fsdp1", "torchtitan", "accelerate", "lightning", "hf_storage", "verl"} <= {
        p.name for p in PRODUCERS if p.on_disk
    }


# the facts a format records for each producer the files name (CheckpointIndex.folders, beside, marks)
FACTS: dict[str, dict[str, Any]] = {
    "accelerate": {"folders": ("optimizer_0", "pytorch_model_fsdp_0")},
    "lightning": {"beside": frozenset({"meta.pt"})},
    "olmo-core": {"folders": ("model_and_optim",)},
    "megatron-core": {"beside": frozenset({"common.pt", "metadata.json", "notes.txt"})},
    "verl": {"marks": frozenset({"rank_files"}), "data_files": ("model_world_size_2_rank_0.pt",)},
    "torch_save": {"marks": frozenset({"rank_files"}), "data_files": ("model_rank_0.pt",)},
    "hf_storage": {"marks": frozenset({"safetensors", "dcp_sharding_info"})},
    "safetensors": {"marks": frozenset({"safetensors"})},
}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_the_facts_the_files_give_name_their_record(name: str) -> None:
    index = CheckpointIndex(checkpoint_id=Path("x"), entries=(), **{"data_files": (), **FACTS[name]})
    assert detect_producer(index) is producers.get(name)


def test_files_name_the_producer_before_keys() -> None:
    """A folder's files win over a key layout another record detects (FSDP2's keys beside Lightning's meta.pt)."""
    keys = _index(("model", "w"), ("optim", "state", "w", "step")).entries
    fsdp2_like = CheckpointIndex(checkpoint_id=Path("x"), entries=keys, data_files=("__0_0.distcp",))
    assert detect_producer(dataclasses.replace(fsdp2_like, beside=frozenset({"meta.pt"}))).name == "lightning"
    assert detect_producer(dataclasses.replace(fsdp2_like, beside=frozenset({"README.md"}))).name != "lightning"


def test_fsdp1_rank_files_have_their_own_row_and_behave_as_fsdp1() -> None:
    marks = frozenset({"rank_files", "sharded_tensor"})
    index = CheckpointIndex(checkpoint_id=Path("x"), entries=(), data_files=("model_world_size_2_rank_0.pt",), marks=marks)
    rank_files, dcp = detect_producer(index), producers.get("fsdp1")
    assert rank_files is not dcp and rank_files.name == "fsdp1" and rank_files.label == "`fsdp1` (rank files)"
    same = ("optimizer_key", "side_files", "merged", "folders", "params_in_model_order")
    assert [getattr(rank_files, f) for f in same] == [getattr(dcp, f) for f in same]


def test_a_merged_file_linked_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    """Lightning's meta.pt (a producer's ``merged`` file) read later: a link out is refused once the producer is named."""
    facts = {"beside": frozenset({"meta.pt"}), "links_out": frozenset({"meta.pt"})}
    (tmp_path / "meta.pt").symlink_to(tmp_path.parent)
    index = CheckpointIndex(checkpoint_id=tmp_path, entries=(), data_files=(), **facts)
    with pytest.raises(UnsafeContentError, match=r"meta\.pt is a symbolic link"):
        detect_producer(index)


def test_megatron_keys_read_by_its_record() -> None:
    """Megatron-Core's flat optimizer keys are its record's rule (``entry_role``, ``optimizer_path``, ``check_optimizer``)."""
    index = _index(("embedding.w",), ("optimizer.state.exp_avg.embedding.w",), ("optimizer.distributed.x",))
    assert roles.classify(index, ())[1].role == "other"  # the shared layouts alone do not read it
    _, state, bucket = producers.classify(index)
    assert (state.role, state.param, state.key) == ("optim_state", "embedding.w", "exp_avg")
    assert bucket.role == "other"
    flat = ("optimizer.state.exp_avg.embedding.w",)
    assert producers.optimizer_path(flat, (*flat, "state", "embedding.w", "exp_avg"), False) == (
        "optimizer", "state", "embedding.w", "exp_avg"
    )  # fmt: skip
    assert producers.optimizer_path(flat, (*flat, "state", "emb.w", "exp_avg"), True) == ("optimizer.state.exp_avg.emb.w",)
    assert producers.optimizer_path(("optim", "state", "w", "step"), ("optim", "state", "w", "step"), False) is None
    with pytest.raises(UnsupportedTransformError, match="dp_reshardable"):
        producers.check_optimizer(_index(("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.x",)))


def test_own_files_are_every_records_files_reshard_writes() -> None:
    """The output check's names of the producers (``own_files``): DCP files, copied side files, merged files, folders."""
    own = producers.own_files()
    for name in (".metadata", "__3_0.distcp", "meta.pt", "common.pt", "metadata.json", "config.json", ".metadata.json",
                 "scheduler.bin", "sampler_1.bin", "scaler.pt", "custom_checkpoint_0.pkl"):  # fmt: skip
        assert own.file(name), name
    for name in ("random_states_0.pkl", "train", "README.md", "model.safetensors"):
        assert not own.file(name), name
    for folder in ("pytorch_model_fsdp_0", "optimizer_1", "model_and_optim"):
        inner = own.folder(folder)
        assert inner is not None and inner.fullmatch("__0_0.distcp") and not inner.fullmatch("notes.txt"), folder
    inner = own.folder("step-1000")  # a DeepSpeed tag folder holds its states files alone, never DCP files
    assert inner is not None and inner.fullmatch("zero_pp_rank_1_mp_rank_00_model_states.pt")
    assert inner.fullmatch("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt") and not inner.fullmatch("__0_0.distcp")
    assert own.file("latest") and own.folder(".step-1000") is None


def _index(*paths: tuple[str | int, ...]) -> CheckpointIndex:
    entries = tuple(
        BytesEntry(fqn=".".join(map(str, p)), path=p, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=1) for p in paths
    )
    return CheckpointIndex(checkpoint_id=Path("x"), entries=entries, data_files=("__0_0.distcp", "__1_0.distcp"))


def test_keys_name_torchtitan_fsdp1_and_dcp() -> None:
    assert detect_producer(_index(("tok.weight",), ("optimizer", "state.tok.weight.step"))).name == "torchtitan"
    assert detect_producer(_index(("model", "_fsdp_wrapped_module.w"), ("optim", "x"))).name == "fsdp1"
    assert detect_producer(_index(("model", "w"), ("train_state", "step"))).name == "dcp"


def test_records_say_what_each_operation_does() -> None:
    accelerate, lightning = producers.get("accelerate"), producers.get("lightning")
    scheduler, rng = accelerate.side_file("scheduler.bin"), accelerate.side_file("random_states_0.pkl")
    assert scheduler is not None and scheduler.action == "copy"
    assert rng is not None and rng.action == "leave_out" and "RNG" in rng.note
    assert accelerate.side_file("meta.pt") is None and accelerate.folders is not None
    assert lightning.merged == "meta.pt" and lightning.optimizer_key == "optimizer"
    assert producers.get("fsdp1").params_in_model_order and not producers.get("fsdp2").params_in_model_order
    with pytest.raises(KeyError):
        producers.get("megatron")


def test_every_optimizer_key_is_one_roles_reads_as_the_optimizer() -> None:
    assert {p.optimizer_key for p in PRODUCERS} <= set(OPTIM_TOPS)
    assert PRODUCERS[-1].name == "dcp" and PRODUCERS[-1].detect(_index(("anything",)))  # the last record takes any index
