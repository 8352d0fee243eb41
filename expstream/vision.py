"""Images and video frames: what a prompt may carry, how it is stored, how a stage reads it back.

A prompt file line may carry ``"images"``: a list of image items, and ``"videos"``: a list of
videos, each a list of frame items (or, when OpenCV is importable, a video file path decoded to
frames; otherwise frame lists only). An item is one of

* a local path (relative to the prompt file's directory), read when the file is read;
* a ``data:image/...;base64,...`` URI, or bare base64 of the image file's bytes;
* from Python, a ``PIL.Image.Image`` (stored as PNG) or ``bytes``.

A URL (``http://``, ``https://``, ``ftp://``, ...) is refused with a clear message: a stage must not
fetch from the internet by surprise; download the image and give its path.

Reading a prompt file checks that the items *exist* (a missing file or a URL is a mistake in the
file: exit 2 naming the line); whether the bytes are a readable image is checked by the stage
that decodes them (:func:`load_image`), so an unreadable, truncated or zero-byte image costs only
its own sample (dead-lettered with the reason), never the run.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from expstream.blobs import BlobStore
from expstream.errors import ConfigError, PoisonRecordError

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_DATA_URI = re.compile(r"^data:([^;,]*)(;base64)?,(.*)$", re.S)
#: Why 4096 characters: a path is short; a longer string without a path separator is base64 data.
_MAX_PATH_CHARS = 4096
#: The first bytes of the image file formats bare base64 may carry (PNG, JPEG, GIF, BMP, WebP/RIFF, TIFF).
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")


class BadImageError(PoisonRecordError):
    """Bytes that are not a readable image (or a video manifest that is not one). Not retriable:
    the sample is dead-lettered with this reason, the rest of its micro-batch goes on."""


def _media_error(where: str, text: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: {text}", field="--prompts", fix=fix)


def item_bytes(item: Any, where: str, base_dir: Path | None = None) -> bytes:
    """The file bytes of one image item (see the module docstring); ConfigError naming ``where``."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if hasattr(item, "save") and hasattr(item, "size"):  # a PIL image
        buf = io.BytesIO()
        item.save(buf, format="PNG")
        return buf.getvalue()
    if not isinstance(item, str):
        raise _media_error(where, f"is a {type(item).__name__}; an image is a path, a data: URI or base64 text",
                           'write e.g. "images": ["cat.png"]')
    if _URL.match(item):
        raise _media_error(where, f"{item[:80]!r} is a URL; expstream does not fetch from the network by surprise",
                           "download the image and give its local path (or a data: URI)")
    m = _DATA_URI.match(item)
    if m:
        if not m.group(2):
            raise _media_error(where, "a data: URI without ;base64 is not supported",
                               "encode the image as data:image/png;base64,...")
        return _b64(m.group(3), where)
    if len(item) <= _MAX_PATH_CHARS:
        path = Path(item)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_file():
            return path.read_bytes()
    try:
        data = base64.b64decode(item.strip(), validate=True)
    except (binascii.Error, ValueError):
        data = None
    # A short path such as "pics/cat" is valid base64 too: bare base64 counts only when it decodes to
    # the signature of an image file format, so that a missing file is reported as missing.
    if data is None or not data.startswith(_IMAGE_MAGIC):
        raise _media_error(where, f"no file {item[:120]!r} (and not base64 of an image file either)",
                           "give an existing image path (relative to the prompt file's directory), a "
                           "data:image/...;base64 URI or base64 of a PNG/JPEG/GIF/BMP/WebP/TIFF file")
    return data


def _b64(text: str, where: str) -> bytes:  # a data: URI's payload
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _media_error(where, f"is neither an existing file nor valid base64 ({exc})",
                           "give a path, a data:image/...;base64 URI or base64 of the image file") from None


def video_frames(item: Any, where: str, base_dir: Path | None = None) -> list[bytes]:
    """A video as the file bytes of its frames: a list of frame items, or a video file path (OpenCV)."""
    if isinstance(item, (list, tuple)):
        if not item:
            raise _media_error(where, "is an empty frame list", "give at least one frame")
        return [item_bytes(f, f"{where}[{i}]", base_dir) for i, f in enumerate(item)]
    if isinstance(item, str) and item.lower().endswith(VIDEO_SUFFIXES) and not _URL.match(item):
        return _decode_video_file(item, where, base_dir)
    raise _media_error(where, "a video is a list of frames (paths, data: URIs or base64), or a video file path",
                       'write e.g. "videos": [["f0.png", "f1.png"]]')


def _decode_video_file(item: str, where: str, base_dir: Path | None) -> list[bytes]:
    path = Path(item) if Path(item).is_absolute() or base_dir is None else base_dir / item
    if not path.is_file():
        raise _media_error(where, f"no file {str(path)!r}", "give an existing video file or a list of frames")
    try:
        import cv2
    except ImportError:
        raise _media_error(where, "decoding a video file needs OpenCV (cv2), which is not installed",
                           "pip install opencv-python-headless, or give the video as a list of frame images") from None
    cap = cv2.VideoCapture(str(path))
    frames = []
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            ok, png = cv2.imencode(".png", frame)
            if ok:
                frames.append(png.tobytes())
    finally:
        cap.release()
    if not frames:
        raise _media_error(where, f"OpenCV read no frame from {str(path)!r}", "check the file, or give frames")
    return frames


def store_video(store: BlobStore, frames: Sequence[bytes]) -> str:
    """Store each frame and a manifest ``{"frames": [refs]}``; returns the manifest's reference."""
    refs = [store.put(f) for f in frames]
    return store.put(json.dumps({"frames": refs}, separators=(",", ":")).encode())


def load_image(data: bytes, what: str) -> Any:
    """A fully decoded RGB PIL image, or BadImageError naming ``what`` and the reason."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImageError(f"{what}: zero bytes; the image file is empty")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()  # decodes every pixel: a truncated file fails here, not later in the processor
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise BadImageError(f"{what}: not a readable image ({type(exc).__name__}: {exc})") from None


def load_video(store: BlobStore, ref: str, what: str) -> list[Any]:
    """The frames (RGB PIL images) of a stored video manifest."""
    try:
        manifest = json.loads(store.get(ref))
        refs = manifest["frames"]
        if not isinstance(refs, list) or not refs:
            raise ValueError("no frames")
    except (ValueError, KeyError, TypeError) as exc:
        raise BadImageError(f"{what}: {ref} is not a video manifest ({exc})") from None
    return [load_image(store.get(r), f"{what} frame {i}") for i, r in enumerate(refs)]


#: The model types whose backbone and processor expstream.vl knows how to feed (critic, reward model).
VL_SCORING_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vl_scoring_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a model directory whose config is a Qwen2-VL / Qwen2.5-VL (``model_type``)."""
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") in VL_SCORING_TYPES


def is_vl_dir(path: str | os.PathLike[str]) -> bool:
    """Whether a model directory holds a vision-language model (a preprocessor config next to it)."""
    p = Path(path)
    if not (p / "preprocessor_config.json").is_file():
        return False
    try:
        return "vision_config" in json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
