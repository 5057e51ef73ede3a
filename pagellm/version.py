"""The package version (its own module: the top-level package imports the engine lazily)."""
__version__ = "0.1.0"
