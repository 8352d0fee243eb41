"""Text from the wire, made safe to print on a terminal.

Header values, error messages, keys and record texts are data that whoever could write to a topic
chose. Printed raw, an ESC byte starts a terminal escape sequence (it can retitle the window, move
the cursor, hide the lines before it, or on some terminals answer back into the input), and a
bidirectional override reorders what the reader sees. :func:`printable` escapes them:

* C0 controls (U+0000-U+001F) but the ones ``keep`` names, DEL (U+007F) and C1 controls
  (U+0080-U+009F, among them the one-byte CSI U+009B) become ``\\xNN``;
* the bidirectional embedding, override and isolate characters (U+202A-U+202E, U+2066-U+2069)
  become ``\\uNNNN``.

Everything else is printed as it is. JSON output needs none of this: ``json.dumps`` escapes every
control character (and with ``ensure_ascii``, everything outside ASCII).
"""

from __future__ import annotations

__all__ = ["printable"]

_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A))


def _escape(ch: str, keep: str) -> str:
    o = ord(ch)
    if ch in keep:
        return ch
    if o < 0x20 or o == 0x7F or 0x80 <= o <= 0x9F:
        return f"\\x{o:02x}"
    if o in _BIDI:
        return f"\\u{o:04x}"
    return ch


def printable(text: str, keep: str = "") -> str:
    """``text`` with control and bidi-override characters escaped (module doc); ``keep``: controls
    left as they are (e.g. ``"\\n"`` for a multi-line message printed as lines)."""
    if text.isprintable() and not any(ord(c) in _BIDI for c in text):
        return text
    return "".join(_escape(c, keep) for c in text)
