"""The package version, in one place (read by the manifest and the CLI)."""

__version__ = "0.1.0"
