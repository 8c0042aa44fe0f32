"""Token-selection policies: each turns a request's KV (and queries) into the indices to keep."""

from .random import RandomParams, middle_chunk_keep, random_keep
from .rkv import RKV_METHODS, RKVParams, rkv_keep, rkv_redundancy, rkv_scores
from .snapkv import SnapKVParams, snapkv_keep, snapkv_scores

__all__ = ["RKV_METHODS", "RKVParams", "RandomParams", "SnapKVParams", "middle_chunk_keep", "random_keep", "rkv_keep",
           "rkv_redundancy", "rkv_scores", "snapkv_keep", "snapkv_scores"]
