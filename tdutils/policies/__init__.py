"""Token-selection policies: each turns a request's KV (and queries) into the indices to keep."""

from .random import RandomParams, middle_chunk_keep, random_keep

__all__ = ["RandomParams", "middle_chunk_keep", "random_keep"]
