"""Open Inference Protocol (KServe V2) gRPC messages for the peer benchmark, in riskserve's venv.

The stubs are generated at import from ``inference_v2.proto`` (upstream field numbers, the subset the
benchmark uses) with grpcio-tools, so nothing generated is committed and no peer's own ``inference``
package is imported here (MLServer's, KServe's and Triton's clash with each other in one process).

Two shapes of call, used by the gateway and by the load generator:

  * a model call: one FP32 ``[rows, 20]`` feature matrix as ``raw_input_contents`` (what the servers' docs
    recommend for speed over typed contents) and requested outputs by name;
  * a decision call: one tensor per request field (FP64 numbers, BYTES categories), answered with
    ``risk_score``, ``credit``, ``fraud`` (FP64) and ``decision`` (BYTES) per row.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pb, services = grpc.protos_and_services("bench/peers/inference_v2.proto")

__all__ = [
    "DECISION_OUTPUTS",
    "decision_request",
    "matrix_request",
    "outputs",
    "pb",
    "services",
]

DECISION_OUTPUTS = ("risk_score", "credit", "fraud", "decision")
_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
_CONTENTS = {
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "INT64": "int64_contents",
    "INT32": "int_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}


def matrix_request(model: str, matrix: NDArray[np.float32], output: str, request_id: str = "") -> Any:
    """A ``ModelInferRequest`` of one FP32 matrix (input ``input-0``) asking for output ``output``."""
    tensor = pb.ModelInferRequest.InferInputTensor(name="input-0", datatype="FP32", shape=list(matrix.shape))
    return pb.ModelInferRequest(
        model_name=model,
        id=request_id,
        inputs=[tensor],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=output)],
        raw_input_contents=[np.ascontiguousarray(matrix, dtype=np.float32).tobytes()],
    )


def decision_request(
    model: str,
    request_id: str,
    numeric: Mapping[str, Sequence[float]],
    categorical: Mapping[str, Sequence[str]],
) -> Any:
    """A ``ModelInferRequest`` carrying the raw request fields column-wise, one tensor per field."""
    inputs = []
    for name, values in numeric.items():
        contents = pb.InferTensorContents(fp64_contents=list(values))
        inputs.append(
            pb.ModelInferRequest.InferInputTensor(
                name=name, datatype="FP64", shape=[len(values), 1], contents=contents
            )
        )
    for name, words in categorical.items():
        contents = pb.InferTensorContents(bytes_contents=[w.encode() for w in words])
        inputs.append(
            pb.ModelInferRequest.InferInputTensor(
                name=name, datatype="BYTES", shape=[len(words), 1], contents=contents
            )
        )
    wanted = [pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in DECISION_OUTPUTS]
    return pb.ModelInferRequest(model_name=model, id=request_id, inputs=inputs, outputs=wanted)


def outputs(response: Any) -> dict[str, NDArray[Any] | list[bytes]]:
    """Each output of a ``ModelInferResponse`` by name: numbers as an array of its shape, BYTES as a list.

    Values come from ``raw_output_contents`` when the server sent them raw (Triton does), else from the
    typed contents.
    """
    out: dict[str, NDArray[Any] | list[bytes]] = {}
    for i, tensor in enumerate(response.outputs):
        if tensor.datatype == "BYTES":
            if response.raw_output_contents:
                out[tensor.name] = _raw_bytes(response.raw_output_contents[i])
            else:
                out[tensor.name] = list(tensor.contents.bytes_contents)
            continue
        dtype = _NUMPY[tensor.datatype]
        if response.raw_output_contents:
            array: NDArray[Any] = np.frombuffer(response.raw_output_contents[i], dtype=dtype)
        else:
            array = np.asarray(getattr(tensor.contents, _CONTENTS[tensor.datatype]), dtype=dtype)
        out[tensor.name] = array.reshape(tuple(tensor.shape)) if tensor.shape else array
    return out


def _raw_bytes(raw: bytes) -> list[bytes]:
    """Triton's raw BYTES encoding: each element is a 4-byte little-endian length and its bytes."""
    items, at = [], 0
    while at < len(raw):
        size = int.from_bytes(raw[at : at + 4], "little")
        items.append(raw[at + 4 : at + 4 + size])
        at += 4 + size
    return items


def positive_class(values: NDArray[Any] | list[bytes]) -> NDArray[np.float64]:
    """The positive-class probability per row of a ``predict_proba`` ``[rows, 2]`` or a ``[rows]`` output."""
    array = np.asarray(values, dtype=np.float64)
    return array[:, 1] if array.ndim == 2 and array.shape[1] == 2 else array.reshape(-1)
