"""The package version, in a leaf module: the lower packages read it here rather than from
`sgl_jax/__init__.py`, which exports the Engine from the top of the package."""

__version__ = "0.1.0"
