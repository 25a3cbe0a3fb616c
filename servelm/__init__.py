"""servelm: a Python framework for serving large language models."""

__version__ = "0.1.0"
