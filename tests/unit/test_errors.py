"""errors.py: each CheckpointError subclass carries the CLI exit code of its kind (3 input, 4 output exists, 2 usage, 1 else)."""

from __future__ import annotations

import pytest

from fsdp_convert import errors
from fsdp_convert.errors import CheckpointError, TerminatedError

EXPECTED = {
    "CheckpointError": 1,
    "CheckpointNotFoundError": 3,
    "NotADcpCheckpointError": 3,
    "MissingDataFileError": 3,
    "UnsafeContentError": 1,
    "CorruptChunkError": 1,
    "CoverageError": 1,
    "ShapeMismatchError": 1,
    "UnsupportedTransformError": 1,
    "InvalidOptionError": 2,
    "OutputExistsError": 4,
    "OutputLockedError": 4,
    "TemporaryExistsError": 4,
    "OutputWriteError": 1,
    "WorkerFailedError": 1,
    "VerificationError": 1,
    "TorchFeatureError": 1,
}


@pytest.mark.parametrize(("name", "code"), sorted(EXPECTED.items()))
def test_exit_code_of_each_error(name: str, code: int) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, CheckpointError)
    assert cls.exit_code == code
    assert cls("x").exit_code == code


def test_every_exported_checkpoint_error_has_an_expected_code() -> None:
    exported = {
        n for n in errors.__all__ if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), CheckpointError)
    }
    assert exported == set(EXPECTED)


def test_terminated_is_not_a_checkpoint_error_and_keeps_its_signal() -> None:
    exc = TerminatedError(15)
    assert not isinstance(exc, Exception)  # `except Exception` cleanup paths do not swallow it
    assert exc.signum == 15 and "15" in str(exc)
