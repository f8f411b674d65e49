"""squeeze's version, in a module that imports nothing (format/ and compression/ stamp it into artifacts)."""

__version__ = "0.1.0"
