"""Images and video frames: what a prompt may carry, how it is stored, how a stage reads it back.

A prompt line's ``"images"`` and ``"videos"`` items are local paths, data URIs or base64 (from
Python: ``PIL`` images or bytes); a URL is refused, nothing is fetched. What a prompt file may read
is confined (:class:`MediaPolicy`: inside the media root, regular files, at most
``run.media_max_mb``): a breach is a ConfigError naming the line and field. Bytes read are checked
(size, signature, full decode) before anything is stored; a failing item is
:class:`RefusedMediaError` (its prompt alone is dead-lettered), and stages decode again what they
read back (:func:`load_image`). The rules and messages: docs/vision.md "Prompt files".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import re
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expstream.errors import ConfigError, PoisonRecordError
from expstream.models.blobs import REF_PREFIX, BlobStore, blob_ref

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_DATA_URI = re.compile(r"^data:([^;,]*)(;base64)?,(.*)$", re.S)
#: Why 4096 characters: a path is short; a longer string without a path separator is base64 data.
_MAX_PATH_CHARS = 4096
#: The first bytes of the image file formats bare base64 may carry (PNG, JPEG, GIF, BMP, WebP/RIFF, TIFF).
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
#: The box types an MP4/MOV file starts with (bytes 4-8), and the EBML magic of MKV/WebM.
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
MIB = 1024 * 1024
#: Why 64 MiB: a large photo is 5-40 MB as PNG, and a real Qwen2-VL processor keeps at most 12.8 M
#: pixels of it; a prompt file's item above that is a mistake, or an attempt to fill the blob store.
#: ``run.media_max_mb`` raises it (a video file counts whole).
DEFAULT_MEDIA_MAX_MB = 64.0
DEFAULT_MEDIA_MAX_BYTES = int(DEFAULT_MEDIA_MAX_MB * MIB)
#: Pseudo file systems: their files are the machine's state (a size of 0, content made on read).
PSEUDO_FS_DIRS = ("/proc", "/sys", "/dev")


class BadImageError(PoisonRecordError):
    """Bytes that are not a readable image (or a video manifest that is not one). Not retriable:
    the sample is dead-lettered with this reason, the rest of its micro-batch goes on."""


class RefusedMediaError(BadImageError):
    """An item whose bytes are not stored: over ``run.media_max_mb``, without an image (or video)
    signature, or not decodable. ``ref`` is the reference the bytes would have had (computed, never
    stored): the prompt's dead letter carries it, so a redrive fails again on the missing blob."""

    def __init__(self, message: str, ref: str) -> None:
        super().__init__(message)
        self.ref = ref


@dataclass(frozen=True)
class RefusedItem:
    """What a prompt row holds instead of a refused item's bytes: the reason and the reference."""

    reason: str
    ref: str


@dataclass(frozen=True)
class MediaPolicy:
    """Where a prompt file's paths may lead and how many bytes an item may have.

    ``base_dir``: where a relative path starts (the prompt file's directory); ``root``: the real
    path (symlinks resolved) every path must resolve inside (None: no path is read, as for the
    media a Python caller puts in a PromptRow); ``max_bytes``: the largest item.
    """

    base_dir: Path | None = None
    root: Path | None = None
    max_bytes: int = DEFAULT_MEDIA_MAX_BYTES

    @classmethod
    def for_prompt_file(cls, prompt_file: str | os.PathLike[str], media_root: str | os.PathLike[str] | None = None,
                        max_mb: float = DEFAULT_MEDIA_MAX_MB) -> MediaPolicy:
        """Relative paths from the prompt file's directory; confined to ``media_root`` (default: that
        directory); items of at most ``max_mb`` MiB (``run.media_max_mb``)."""
        base = Path(prompt_file).resolve().parent
        if media_root is None or str(media_root) == "":
            root = Path(os.path.realpath(base))
        else:
            root = Path(os.path.realpath(Path(media_root).expanduser()))
            if not root.is_dir():
                raise ConfigError(f"--media-root {str(media_root)!r} is not a directory", field="--media-root",
                                  fix="name the directory that holds the prompt file's images and videos")
        if not (isinstance(max_mb, (int, float)) and not isinstance(max_mb, bool) and max_mb > 0):
            raise ConfigError(f"run.media_max_mb: got {max_mb!r}; give a size in MiB > 0", field="run.media_max_mb",
                              fix=f"e.g. {DEFAULT_MEDIA_MAX_MB:g}")
        return cls(base_dir=base, root=root, max_bytes=int(max_mb * MIB))


def _media_error(where: str, text: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: {text}", field="--prompts", fix=fix)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo (named pipe)"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _file_ref(fd: int) -> str:
    """The reference of an open file's whole content, hashed in chunks (nothing kept)."""
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return REF_PREFIX + digest.hexdigest()


def _read_file(item: str, where: str, policy: MediaPolicy) -> bytes | None:
    """The bytes of the file ``item`` names, inside the policy's root; None when there is no such path.

    ConfigError for a path outside the root (after symlinks), on /proc, /sys or /dev, or not a
    regular file; RefusedMediaError for a file over the size limit (its bytes are not kept).
    """
    if policy.root is None:
        return None
    path = Path(item)
    if not path.is_absolute():
        path = (policy.base_dir or Path.cwd()) / path
    if not os.path.lexists(path):
        return None
    real = Path(os.path.realpath(path))
    fix_root = (f"copy the file under {policy.root}, or name a directory that holds it with --media-root DIR "
                "(run.media_root)")
    if not real.is_relative_to(policy.root):
        raise _media_error(where, f"{item[:200]!r} resolves to {str(real)!r}, outside the media root {str(policy.root)!r} "
                                  "(a prompt file reads only files under its media root)", fix_root)
    for pseudo in PSEUDO_FS_DIRS:
        if real.is_relative_to(pseudo):
            raise _media_error(where, f"{item[:200]!r} resolves to {str(real)!r}, on the pseudo file system {pseudo}: "
                                      "its bytes are the machine's state, not an image", "give an image file")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None  # a dangling symlink: reported as a missing file
    except OSError as exc:
        raise _media_error(where, f"cannot read {item[:200]!r} ({exc.strerror})", "check the file's permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise _media_error(where, f"{item[:200]!r} is a {_file_kind(st.st_mode)}, not a regular file",
                           "give an image file")
    try:
        # O_NOFOLLOW and the inode check: what is read is the file that was checked
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _media_error(where, f"cannot read {item[:200]!r} ({exc.strerror})", "check the file's permissions") from None
    with os.fdopen(fd, "rb") as fh:
        fst = os.fstat(fh.fileno())
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
            raise _media_error(where, f"{item[:200]!r} changed while it was checked", "do not modify the images "
                                      "while a run reads the prompt file")
        if fst.st_size > policy.max_bytes:
            raise RefusedMediaError(f"{where}: {item[:200]!r} has {fst.st_size} bytes, over the limit of "
                                    f"{policy.max_bytes} (run.media_max_mb)", _file_ref(fh.fileno()))
        data = fh.read(policy.max_bytes + 1)
    if len(data) != fst.st_size:
        raise _media_error(where, f"{item[:200]!r}: read {len(data)} bytes where its size says {fst.st_size} "
                                  "(changed while read, or not a plain file)", "give an image file that is not "
                                  "being written")
    return data


def _raw_bytes(item: Any, where: str, policy: MediaPolicy) -> bytes:
    """The bytes of one image item as given (path, data: URI, base64, bytes, PIL), not yet checked."""
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
        data = _read_file(item, where, policy)
        if data is not None:
            return data
    try:
        data = base64.b64decode(item.strip(), validate=True)
    except (binascii.Error, ValueError):
        data = None
    # A short path such as "pics/cat" is valid base64 too: bare base64 counts only when it decodes to
    # the signature of an image file format, so that a missing file is reported as missing.
    if data is None or not data.startswith(_IMAGE_MAGIC):
        if policy.root is None:
            raise _media_error(where, f"{item[:120]!r} is not base64 of an image file (and paths are read only "
                                      "from a prompt file)", "give bytes, a PIL image, a data:image/...;base64 "
                                      "URI, or read the prompt file with expstream.launch.prompts.read_prompts")
        raise _media_error(where, f"no file {item[:120]!r} (and not base64 of an image file either)",
                           "give an existing image path (relative to the prompt file's directory), a "
                           "data:image/...;base64 URI or base64 of a PNG/JPEG/GIF/BMP/WebP/TIFF file")
    return data


def check_image(data: bytes, where: str, max_bytes: int = DEFAULT_MEDIA_MAX_BYTES) -> None:
    """RefusedMediaError unless ``data`` is at most ``max_bytes``, starts with the signature of an
    image file format and decodes in full; checked before anything is stored."""
    ref = blob_ref(data)
    if not data:
        raise RefusedMediaError(f"{where}: zero bytes; the image file is empty", ref)
    if len(data) > max_bytes:
        raise RefusedMediaError(f"{where}: {len(data)} bytes, over the limit of {max_bytes} (run.media_max_mb)", ref)
    if not data.startswith(_IMAGE_MAGIC):
        raise RefusedMediaError(f"{where}: not a readable image: it does not start with the signature of a PNG, "
                                "JPEG, GIF, BMP, WebP or TIFF file", ref)
    try:
        _decoded(data, where)
    except BadImageError as exc:
        raise RefusedMediaError(str(exc), ref) from None


def item_bytes(item: Any, where: str, policy: MediaPolicy | None = None) -> bytes:
    """The checked file bytes of one image item (see the module docstring): ConfigError naming
    ``where`` for a mistake in the file, RefusedMediaError for bytes that are not an image.
    Without ``policy`` (a Python caller) no path is read."""
    policy = policy or MediaPolicy()
    data = _raw_bytes(item, where, policy)
    check_image(data, where, policy.max_bytes)
    return data


def read_image(item: Any, where: str, policy: MediaPolicy | None = None) -> bytes | RefusedItem:
    """:func:`item_bytes`, with a refused item as its :class:`RefusedItem` (ConfigError still raised)."""
    try:
        return item_bytes(item, where, policy)
    except RefusedMediaError as exc:
        return RefusedItem(str(exc), exc.ref)


def _b64(text: str, where: str) -> bytes:  # a data: URI's payload
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _media_error(where, f"is neither an existing file nor valid base64 ({exc})",
                           "give a path, a data:image/...;base64 URI or base64 of the image file") from None


def video_manifest(frame_refs: Sequence[str]) -> bytes:
    """The bytes of a video's manifest blob: ``{"frames": [refs]}``."""
    return json.dumps({"frames": list(frame_refs)}, separators=(",", ":")).encode()


def read_video(item: Any, where: str, policy: MediaPolicy | None = None) -> list[bytes] | RefusedItem:
    """A video as the checked bytes of its frames (a list of frame items, or a video file path decoded
    with OpenCV), or its :class:`RefusedItem` when a frame or the file is refused."""
    if isinstance(item, (list, tuple)):
        if not item:
            raise _media_error(where, "is an empty frame list", "give at least one frame")
        frames = [read_image(f, f"{where}[{i}]", policy) for i, f in enumerate(item)]
        refused = [f for f in frames if isinstance(f, RefusedItem)]
        if refused:
            refs = [f.ref if isinstance(f, RefusedItem) else blob_ref(f) for f in frames]
            return RefusedItem("; ".join(f.reason for f in refused), blob_ref(video_manifest(refs)))
        return frames  # type: ignore[return-value]
    if isinstance(item, str) and item.lower().endswith(VIDEO_SUFFIXES) and not _URL.match(item):
        try:
            return _decode_video_file(item, where, policy)
        except RefusedMediaError as exc:
            return RefusedItem(str(exc), exc.ref)
    raise _media_error(where, "a video is a list of frames (paths, data: URIs or base64), or a video file path",
                       'write e.g. "videos": [["f0.png", "f1.png"]]')


def _is_video(data: bytes) -> bool:
    return (data[4:8] in _MP4_BOXES or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")
            or data.startswith(_EBML_MAGIC))


def _decode_video_file(item: str, where: str, policy: MediaPolicy | None) -> list[bytes]:
    data = _read_file(item, where, policy or MediaPolicy())
    if data is None:
        raise _media_error(where, f"no file {item[:200]!r}", "give an existing video file or a list of frames")
    ref = blob_ref(data)
    if not _is_video(data):
        raise RefusedMediaError(f"{where}: not a readable video: it does not start with the signature of an MP4, "
                                "MOV, AVI, MKV or WebM file", ref)
    try:
        import cv2
    except ImportError:
        raise _media_error(where, "decoding a video file needs OpenCV (cv2), which is not installed",
                           "pip install opencv-python-headless, or give the video as a list of frame images") from None
    frames = []
    # OpenCV reads a path: it gets a private copy of the bytes that were checked, not the original
    with tempfile.NamedTemporaryFile(suffix=Path(item).suffix.lower()) as tmp:
        tmp.write(data)
        tmp.flush()
        cap = cv2.VideoCapture(tmp.name)
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
        raise RefusedMediaError(f"{where}: OpenCV read no frame from {item[:200]!r}", ref)
    return frames


def store_video(store: BlobStore, frames: Sequence[bytes]) -> str:
    """Store each frame and a manifest ``{"frames": [refs]}``; returns the manifest's reference."""
    refs = [store.put(f) for f in frames]
    return store.put(video_manifest(refs))


def _decoded(data: bytes, what: str) -> Any:
    """The PIL image of ``data`` with every pixel decoded, or BadImageError naming ``what``."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImageError(f"{what}: zero bytes; the image file is empty")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()  # decodes every pixel: a truncated file fails here, not later in the processor
        return img
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImageError(f"{what}: not a readable image ({type(exc).__name__}: {exc})") from None


def load_image(data: bytes, what: str) -> Any:
    """A fully decoded RGB PIL image, or BadImageError naming ``what`` and the reason."""
    return _decoded(data, what).convert("RGB")


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


#: The model types whose backbone and processor expstream.models.vl knows how to feed (critic, reward model).
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
