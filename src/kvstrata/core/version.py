"""kvstrata's version, in one place: the package metadata (pyproject's dynamic version),
`kvstrata.__version__` and `kvstrata --version` all read it."""

__version__ = "0.1.0"
