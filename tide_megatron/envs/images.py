"""Image observations: what a screenshot may be, checked the same way on both ends.

An env returns a screenshot as encoded PNG or JPEG bytes. Before the server stores it, and
again when the client reads it back, `validate_image` checks, in this order and each with a
one-line reason (`ImageError`):

1. size: non-empty and at most `ImageLimits.max_bytes`;
2. format: the magic bytes say PNG (`89 50 4E 47 0D 0A 1A 0A`) or JPEG (`FF D8 FF`), and that
   format is one of `ImageLimits.formats` (a name or a Content-Type is never trusted);
3. completeness: a PNG ends with its IEND chunk, a JPEG with its EOI marker (`FF D9`), so a
   truncated transfer is caught even where Pillow is told to load truncated images;
4. dimensions, read from the header before any pixel is decoded: width <= max_width,
   height <= max_height, width * height <= max_pixels (no decompression bomb is expanded);
5. decoding: every pixel decodes (a corrupt stream fails here).

The result, `ImageInfo`, carries the format, the decoded size and the sha256 of the bytes;
the image store publishes exactly these in an `ImageRef`, and the client checks them again.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tide_megatron.envs.config import ImageLimits
from tide_megatron.envs.protocol import IMAGE_FORMATS, ImageRef

if TYPE_CHECKING:
    from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"

_PNG_IEND = b"IEND\xaeB`\x82"  # the IEND chunk type and its fixed CRC
_JPEG_EOI = b"\xff\xd9"
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


class ImageError(ValueError):
    """An image that is not acceptable; the message says what is wrong in one line."""


@dataclass(frozen=True)
class ImageInfo:
    format: str
    """`png` or `jpeg`."""
    width: int
    height: int
    nbytes: int
    sha256: str
    """Hex digest of the encoded bytes."""


def sniff_format(data: bytes) -> str | None:
    """`png` or `jpeg` from the magic bytes, else None."""
    if data[:8] == PNG_MAGIC:
        return "png"
    if data[:3] == JPEG_MAGIC:
        return "jpeg"
    return None


def validate_image(data: bytes, limits: ImageLimits) -> ImageInfo:
    """Check `data` against `limits` (see the module docstring); raises `ImageError`."""
    if not isinstance(data, (bytes, bytearray)):
        raise ImageError(f"image must be bytes, got {type(data).__name__}")
    n = len(data)
    if n == 0:
        raise ImageError("empty image (0 bytes)")
    if n > limits.max_bytes:
        raise ImageError(f"image of {n} bytes is over max_bytes={limits.max_bytes}")
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError(f"not a PNG or JPEG image (first bytes {bytes(data[:8])!r})")
    if fmt not in limits.formats:
        raise ImageError(f"{fmt} images are not accepted (formats={list(limits.formats)})")
    if fmt == "png" and not data.endswith(_PNG_IEND):
        raise ImageError(f"truncated png: {n} bytes and no IEND chunk at the end")
    if fmt == "jpeg" and not data.endswith(_JPEG_EOI):
        raise ImageError(f"truncated jpeg: {n} bytes and no end-of-image marker at the end")
    if fmt == "png" and data[12:16] == b"IHDR":  # the header Pillow would read, checked before it does
        _check_size(fmt, int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), limits)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[fmt]]) as img:
            width, height = img.size
            _check_size(fmt, width, height, limits)
            img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"{fmt} refused before decoding: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"undecodable {fmt} ({type(e).__name__}: {e})") from None
    return ImageInfo(fmt, width, height, n, hashlib.sha256(data).hexdigest())


def _check_size(fmt: str, width: int, height: int, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"{fmt} of {width}x{height} pixels has no area")
    if width > limits.max_width or height > limits.max_height:
        raise ImageError(f"{fmt} of {width}x{height} is over max_width x max_height = "
                         f"{limits.max_width}x{limits.max_height}")
    if width * height > limits.max_pixels:
        raise ImageError(f"{fmt} of {width}x{height} = {width * height} pixels is over max_pixels={limits.max_pixels}")


def decode_image(data: bytes) -> Image.Image:
    """The decoded image, in RGB (for a processor); `data` should have passed `validate_image`."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def encode_image(img: Image.Image, fmt: str = "png", jpeg_quality: int = 85) -> bytes:
    """PNG or JPEG bytes of a Pillow image, deterministic for equal pixels (no timestamps)."""
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, format="PNG", optimize=False, compress_level=6)
    elif fmt == "jpeg":
        img.convert("RGB").save(buf, format="JPEG", quality=jpeg_quality)
    else:
        raise ValueError(f"unknown image format {fmt!r}; formats are {IMAGE_FORMATS}")
    return buf.getvalue()


def check_against_ref(data: bytes, ref: ImageRef, limits: ImageLimits) -> None:
    """Validate image bytes read back for `ref` and check they are the image it names."""
    if len(data) != ref.nbytes:
        raise ImageError(f"image {ref.id}: read {len(data)} bytes, the reference says {ref.nbytes}")
    info = validate_image(data, limits)
    if info.sha256 != ref.sha256:
        raise ImageError(f"image {ref.id}: sha256 {info.sha256[:12]}... does not match the reference's {ref.sha256[:12]}...")
    if (info.format, info.width, info.height) != (ref.format, ref.width, ref.height):
        raise ImageError(f"image {ref.id}: decoded {info.format} {info.width}x{info.height}, the reference says "
                         f"{ref.format} {ref.width}x{ref.height}")


def read_image_file(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The bytes of `ref` read from its path, checked (`check_against_ref`).

    Opened without following links and without blocking, and only if it is a regular file no
    larger than `limits.max_bytes`: a path from a server is never trusted to be a plain file.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(ref.path, flags)
    except OSError as e:
        raise ImageError(f"image {ref.id}: cannot open {ref.path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"image {ref.id}: {ref.path} is not a regular file")
        if st.st_size > limits.max_bytes:
            raise ImageError(f"image {ref.id}: {ref.path} has {st.st_size} bytes, over max_bytes={limits.max_bytes}")
        data = f.read(limits.max_bytes + 1)
    check_against_ref(data, ref, limits)
    return data
