"""What happens to ONE decision: the gRPC front door, the ingress, the decision flow and the model calls."""

__all__: list[str] = []
