"""riskserve: serve a risk-decision pipeline of very different models as one system on Ray Serve."""

__version__ = "0.1.0"

__all__ = ["__version__"]
