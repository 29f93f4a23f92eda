"""Exactly-once data at any world size: the elastic sampler (:mod:`.sampler`), the memory-mapped token
dataset (:mod:`.dataset`) and the constant global batch (:mod:`.batching`)."""
