"""A pull-through caching artifact proxy for PyPI, Maven and the Gradle build cache."""

__version__ = "0.1.0"
