"""The feature spec and the shared feature stage (built with the pipeline)."""

__all__: list[str] = []
