"""The package's version, in a module of its own so that any folder can name it without importing
the package's face (``overflow_fast/__init__.py``)."""

__version__ = "0.1.0"
