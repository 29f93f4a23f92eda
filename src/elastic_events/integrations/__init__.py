"""Elasticity for the training frameworks people already use.

* :mod:`elastic_events.integrations.transformers` — Hugging Face ``Trainer``
  (``pip install hyperpodrun[hf]``).
* :mod:`elastic_events.integrations.lightning` — Lightning 2.x ``Trainer``
  (``pip install hyperpodrun[lightning]``).

Importing this package imports neither framework; each submodule imports its
framework when it is imported itself.
"""
