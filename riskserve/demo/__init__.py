"""Demo models built by the project itself: a synthetic card-transaction data set and the models on it."""

__all__: list[str] = []
