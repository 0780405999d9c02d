"""Producers: detection, the table's records, and the docs' tables generated from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_convert import producers
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


@pytest.mark.parametrize("name", ["accelerate", "lightning", "verl", "torch_save", "hf_storage", "safetensors"])
def test_a_name_the_files_give_is_its_record(name: str) -> None:
    index = CheckpointIndex(checkpoint_id=Path("x"), entries=(), data_files=(), producer=name)
    assert detect_producer(index) is producers.get(name)


def test_fsdp1_rank_files_have_their_own_row_and_behave_as_fsdp1() -> None:
    index = CheckpointIndex(checkpoint_id=Path("x"), entries=(), data_files=(), producer="fsdp1")
    rank_files, dcp = detect_producer(index), producers.get("fsdp1")
    assert rank_files is not dcp and rank_files.name == "fsdp1" and rank_files.label == "`fsdp1` (rank files)"
    same = ("optimizer_key", "side_files", "merged", "folders", "params_in_model_order")
    assert [getattr(rank_files, f) for f in same] == [getattr(dcp, f) for f in same]


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
