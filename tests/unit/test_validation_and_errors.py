"""Input checks every backend shares, and the error tree's gRPC statuses."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from riskserve.platform import errors
from riskserve.platform.errors import InvalidInput, MissingExtra, RiskServeError
from riskserve.platform.extras import require
from riskserve.platform.validation import check_feature_matrix, check_texts

NAMES = ["amount", "age", "velocity"]


def test_a_good_matrix_is_returned_as_is_even_read_only() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    x.setflags(write=False)
    assert check_feature_matrix(x, NAMES) is x


@pytest.mark.parametrize(
    ("batch", "field", "message"),
    [
        (np.array([[1, 2, np.nan]], dtype=np.float32), "velocity", "nan"),
        (np.array([[1, -np.inf, 2]], dtype=np.float32), "age", "-inf"),
        (np.ones((2, 2), dtype=np.float32), "features", "expected 3 columns"),
        (np.ones((2, 3), dtype=np.float64), "features", "float32"),
        (np.asfortranarray(np.ones((2, 3), dtype=np.float32)), "features", "C-contiguous"),
        (np.ones(3, dtype=np.float32), "features", "2-D"),
        (np.ones((0, 3), dtype=np.float32), "features", "no rows"),
        ([[1.0, 2.0, 3.0]], "features", "numpy"),
    ],
)
def test_bad_matrices_name_the_field(batch: object, field: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as info:
        check_feature_matrix(batch, NAMES)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("batch", "message"),
    [("one string", "sequence"), ([], "no texts"), (["ok", ""], "row 1 is empty"), (["ok", 3], "row 1"),
     (["x" * 11], "at most 10")],
)  # fmt: skip
def test_bad_texts_name_the_field(batch: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as info:
        check_texts(batch, max_chars=10)
    assert info.value.field == "text"


def test_every_error_maps_to_one_grpc_status_and_never_unknown() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(cls, RiskServeError) for cls in classes)
    statuses = {cls.__name__: cls.grpc_status for cls in classes}
    assert grpc.StatusCode.UNKNOWN not in statuses.values()
    assert statuses["InvalidInput"] is grpc.StatusCode.INVALID_ARGUMENT
    assert statuses["ModelUnavailable"] is grpc.StatusCode.UNAVAILABLE
    assert statuses["Overloaded"] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert statuses["NotFound"] is grpc.StatusCode.NOT_FOUND
    assert statuses["ArtifactIntegrityError"] is grpc.StatusCode.FAILED_PRECONDITION


def test_a_missing_extra_names_it() -> None:
    with pytest.raises(MissingExtra, match=r"riskserve\[cpu\]") as info:
        require("riskserve_no_such_module", backend="vllm", extra="cpu")
    assert isinstance(info.value, ImportError)
    assert require("json", backend="x", extra="y").__name__ == "json"


def test_errors_survive_pickling_across_processes_with_their_fields() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(InvalidInput("is missing", field="amount")))
    assert isinstance(error, InvalidInput)
    assert error.field == "amount"
    assert str(error) == "amount: is missing"
    extra = pickle.loads(pickle.dumps(MissingExtra("vllm", "cpu", "vllm")))
    assert extra.extra == "cpu"
    assert "riskserve[cpu]" in str(extra)
