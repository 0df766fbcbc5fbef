"""Generated protobuf package; see riskserve/pipelines/proto/generate.py."""
