"""Query capture for the embedded engine; it lives in `tdutils.attention` (with the attention it records), and
these names stay importable from here."""

from ..attention import AttentionRecorder, QueryRecorder, capture_implementation, recording

__all__ = ["AttentionRecorder", "QueryRecorder", "capture_implementation", "recording"]
