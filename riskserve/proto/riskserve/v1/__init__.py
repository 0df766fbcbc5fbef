"""Generated protobuf package; see riskserve/proto/generate.py."""
