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
    """A text file is not valid UTF-8 (the message names the file, the line and byte offset of the first bad byte,
    the bytes there and how to fix it)."""


def not_utf8_error(path, exc: UnicodeDecodeError) -> NotUTF8Error:
    """The error for `path`, naming the line and byte offset of its first byte that is not UTF-8.

    A decoder reports offsets within the chunk it was reading, not the file, so the file's bytes are decoded
    again here (only when reading failed) to find where.
    """
    bad, where = exc.object[exc.start:exc.start + 4], ""
    try:
        raw = Path(path).read_bytes()
        raw.decode(READ_ENCODING)
    except UnicodeDecodeError as whole:
        data, start = whole.object, whole.start  # utf-8-sig: offsets after the byte-order mark it removed
        bad = data[start:start + 4]
        offset = start + (len(raw) - len(data))
        before = data[:start].replace(b"\r\n", b"\n").replace(b"\r", b"\n")  # universal newlines, as read
        line = before.count(b"\n") + 1
        where = f"line {line}, byte offset {offset}: "
    except OSError:  # gone since: report what the reader saw, without a place
        pass
    return NotUTF8Error(f"{str(path)!r} is not UTF-8 text ({where}byte 0x{bad[:1].hex()} in {bytes(bad)!r} cannot be "
                        f"decoded); save it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN > OUT)")


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
            raise not_utf8_error(path, exc) from None


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
            raise not_utf8_error(path, exc) from None


__all__ = ["READ_ENCODING", "WRITE_ENCODING", "NotUTF8Error", "iter_lines", "not_utf8_error", "read_text"]
