"""riskserve's gRPC contract and the Python code generated from it.

The contract is ``riskserve/v1/risk_pipeline.proto`` (protobuf package ``riskserve.v1``); the generated
modules are importable as ``riskserve.proto.riskserve.v1.risk_pipeline_pb2`` and
``..._pb2_grpc``. Regenerate with ``python -m riskserve.proto.generate`` and check for drift
with ``--check``.
"""

__all__: list[str] = []
