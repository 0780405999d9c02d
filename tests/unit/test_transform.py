"""transform.py: FQN cleaning, renames, include/exclude, casts and optimizer ids, on hand-made indexes."""

from __future__ import annotations

import pytest

from fsdp_convert.transform import clean_fqn


@pytest.mark.parametrize(
    ("fqn", "clean"),
    [
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("layers.0._checkpoint_wrapped_module.mlp.0.weight", "layers.0.mlp.0.weight"),
        ("_orig_mod.output.weight", "output.weight"),
        ("module._orig_mod.output.weight", "output.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # only a leading module. is DDP's
        ("module", "module"),
    ],
)
def test_clean_fqn(fqn: str, clean: str) -> None:
    assert clean_fqn(fqn) == clean
    assert clean_fqn(fqn, keep_wrapper_names=True) == fqn
