"""What a pipeline IS: the YAML schema, its pools, endpoints and decision rules; pure data, no Ray."""

__all__: list[str] = []
