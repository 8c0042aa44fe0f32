"""The printed forms of times and counts (`tdutils.metrics.duration_text`, `plural`)."""

from tdutils.metrics import duration_text, plural


def test_duration_text_and_plural():
    assert [duration_text(s) for s in (0.2, 1.0, 44.6, 59.4, 59.6, 192.0)] == [
        "under 1 s", "1 s", "45 s", "59 s", "1.0 min", "3.2 min"]
    assert plural(1, "prompt") == "1 prompt"
    assert plural(0, "prompt") == "0 prompts"
    assert plural(2, "batch", "batches") == "2 batches"
    assert plural(1, "batch", "batches") == "1 batch"
