"""servelab: see, measure and tune the two phases of LLM inference."""

__version__ = "0.1.0"
