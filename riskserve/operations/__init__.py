"""Running a system: build and deploy the Serve application, up/down, swap, publish, shadow, learn, status."""

__all__: list[str] = []
