"""The weight cache's version, part of every checkpoint's compatibility stamp (config.py)."""

__version__ = "0.1.0"
