"""hyperpodrun: an elastic, fault-tolerant drop-in replacement for ``torchrun``."""

__version__ = "0.1.0"

__all__ = ["__version__"]
