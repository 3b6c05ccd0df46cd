"""Images as Caffe sees them (through OpenCV): uint8 arrays (C, H, W), colour channels in BGR order.

Pillow does the decoding; the channel order and the colour rules follow
OpenCV's imread/imdecode, so a net trained by Caffe on the same files sees
the same layout.
"""
from __future__ import annotations

import io

import numpy as np

_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")


def _to_array(img, color) -> np.ndarray:
    """color None: keep grey images grey (IMREAD_ANYCOLOR); True: 3 channels; False: 1."""
    if color is None:
        color = img.mode not in _GRAY_MODES
    if color:
        rgb = np.asarray(img.convert("RGB"))
        return np.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))   # RGB -> BGR
    return np.asarray(img.convert("L"))[None].copy()


def _open(source, what):
    from PIL import Image, UnidentifiedImageError
    try:
        img = Image.open(source)
        img.load()
    except UnidentifiedImageError:
        raise ValueError(f"{what}: not an image Pillow can decode") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot read image: {e.strerror or e}") from None
    return img


def decode(buf: bytes, color=None, what="encoded image") -> np.ndarray:
    """Decode PNG/JPEG/... bytes to (C, H, W) uint8 BGR (Caffe's DecodeDatumToCVMat)."""
    return _to_array(_open(io.BytesIO(buf), what), color)


def load(path, height=0, width=0, color=True) -> np.ndarray:
    """Read an image file, resized to height x width when both are set (Caffe's ReadImageToCVMat)."""
    img = _open(path, str(path))
    if height > 0 and width > 0:
        from PIL import Image
        img = img.convert("RGB" if color else "L").resize((width, height), Image.BILINEAR)
    return _to_array(img, bool(color))


def encode(array: np.ndarray, fmt="png") -> bytes:
    """(C, H, W) uint8 BGR (C = 1 or 3) -> bytes of the format named by its extension (png, jpg, ...)."""
    from PIL import Image
    name = Image.registered_extensions().get("." + fmt.lower())
    if name is None:
        raise ValueError(f"cannot encode images as {fmt!r}")
    a = np.asarray(array, dtype=np.uint8)
    img = Image.fromarray(a[0] if a.shape[0] == 1 else np.ascontiguousarray(a[::-1].transpose(1, 2, 0)))
    out = io.BytesIO()
    img.save(out, format=name)
    return out.getvalue()
