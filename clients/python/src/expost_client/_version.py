"""The distribution's version (read by clients/python/pyproject.toml and sent in the User-Agent)."""

__version__ = "0.1.0"
