"""A pull-through caching artifact proxy for PyPI, Maven, npm, the Gradle build cache and
raw files."""

__version__ = "0.1.0"
