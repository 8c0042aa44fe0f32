"""Token-selection policies: each turns a request's KV (and queries) into the indices to keep."""

from .random import RandomParams, middle_chunk_keep, random_keep
from .snapkv import SnapKVParams, snapkv_keep, snapkv_scores

__all__ = ["RandomParams", "SnapKVParams", "middle_chunk_keep", "random_keep", "snapkv_keep", "snapkv_scores"]
