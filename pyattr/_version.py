"""The package version (one place: the root, the command line and run manifests read it)."""

__version__ = "0.1.0"
