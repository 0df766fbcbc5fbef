"""Pipeline YAML spec, graph builder, decision rules, gRPC ingress and client (built with the pipeline)."""

__all__: list[str] = []
