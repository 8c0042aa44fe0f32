"""Reading and writing the text files tdutils opens: always UTF-8, a leading byte-order mark tolerated.

Python's `open()` and `Path.read_text()` without `encoding=` use the locale's encoding (cp1252 on Windows,
ASCII under `LANG=C`), so the same file reads differently on different machines, and `json.loads` refuses
a UTF-8 file saved with a byte-order mark (`Unexpected UTF-8 BOM`). Every text file tdutils reads goes
through `read_text` / `iter_lines` (encoding `READ_ENCODING`, `utf-8-sig`: UTF-8, one leading BOM removed
when present); every text file it writes names `encoding=WRITE_ENCODING` (UTF-8, no BOM).
"""

from __future__ import annotations

from pathlib import Path

READ_ENCODING = "utf-8-sig"  # UTF-8; a leading byte-order mark is removed, none is required
WRITE_ENCODING = "utf-8"


class NotUTF8Error(ValueError):
    """A text file is not valid UTF-8 (the message names the file, the bad bytes and how to fix it)."""


def _not_utf8(path, exc: UnicodeDecodeError) -> NotUTF8Error:
    bad = exc.object[exc.start:exc.start + 4]
    return NotUTF8Error(f"{str(path)!r} is not UTF-8 text (byte 0x{bad[:1].hex()} in {bytes(bad)!r} cannot be decoded); "
                        f"save it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN > OUT)")


def read_text(path: str | Path) -> str:
    """The whole text of `path`, decoded as UTF-8 with a leading byte-order mark removed.

    Line endings are read as `Path.read_text` reads them (universal newlines: `\\r\\n` and `\\r` become `\\n`).

    Raises:
        OSError: the file cannot be read (FileNotFoundError, IsADirectoryError, ...).
        NotUTF8Error (a ValueError): the bytes are not UTF-8.
    """
    with open(path, encoding=READ_ENCODING) as f:
        try:
            return f.read()
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc) from None


def iter_lines(path: str | Path):
    """Yield the lines of `path` (universal newlines, each with its `\\n`), decoded as UTF-8, BOM removed.

    Raises:
        OSError: the file cannot be read.
        NotUTF8Error (a ValueError): the bytes are not UTF-8 (raised when the bad line is reached).
    """
    with open(path, encoding=READ_ENCODING) as f:
        try:
            yield from f
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc) from None


__all__ = ["READ_ENCODING", "WRITE_ENCODING", "NotUTF8Error", "iter_lines", "read_text"]
