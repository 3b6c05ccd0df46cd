"""Images as Caffe sees them (through OpenCV): uint8 arrays (C, H, W), colour channels in BGR order.

Where opencv-python-headless is installed (the ``opencv`` extra) OpenCV itself
decodes (cv::imread/imdecode) and resizes (cv::resize, INTER_LINEAR), as
Caffe's C++ does. Without it Pillow decodes, with OpenCV's channel order and
colour rules, and resizes bilinearly; Pillow's bilinear widens its filter when
shrinking (an area average), where OpenCV samples pixel pairs, so downscaled
images differ. ``SNCAFFE_IMAGES=pillow`` forces Pillow; ``backend()`` names the one in use.
"""
from __future__ import annotations

import io

import numpy as np

from .. import config

_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")


def _cv2():
    """OpenCV, unless absent or SNCAFFE_IMAGES=pillow."""
    if config.settings.images == "pillow":
        return None
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def backend() -> str:
    return "opencv" if _cv2() is not None else "pillow"


def _cv_flag(cv2, color):
    return cv2.IMREAD_ANYCOLOR if color is None else (cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE)


def _cv_chw(a) -> np.ndarray:
    return a[None].copy() if a.ndim == 2 else np.ascontiguousarray(a.transpose(2, 0, 1))


def resize(im: np.ndarray, size, order=1) -> np.ndarray:
    """H x W x K (any dtype) -> size=(height, width): cv::resize where OpenCV is installed
    (order 0 INTER_NEAREST, 1 INTER_LINEAR, 3 INTER_CUBIC), else Pillow per channel."""
    h, w = int(size[0]), int(size[1])
    cv2 = _cv2()
    if cv2 is not None:
        interp = {0: cv2.INTER_NEAREST, 1: cv2.INTER_LINEAR}.get(order, cv2.INTER_CUBIC)
        chans = [cv2.resize(np.ascontiguousarray(im[:, :, k:k + 4]), (w, h), interpolation=interp)
                 for k in range(0, im.shape[2], 4)]     # cv::resize takes at most 4 channels at once
        return np.concatenate([c.reshape(h, w, -1) for c in chans], axis=2)
    from PIL import Image
    interp = {0: Image.NEAREST, 1: Image.BILINEAR}.get(order, Image.BICUBIC)
    out = [np.asarray(Image.fromarray(np.ascontiguousarray(im[:, :, k], dtype=np.float32), "F")
                      .resize((w, h), interp)) for k in range(im.shape[2])]
    return np.stack(out, axis=2).astype(im.dtype)


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
    except Image.DecompressionBombError as e:     # its size is checked before any pixel is decoded
        raise ValueError(f"{what}: {e}") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot read image: {e.strerror or e}") from None
    except (ValueError, TypeError, IndexError, EOFError, SyntaxError, ZeroDivisionError) as e:   # a damaged file,
        raise ValueError(f"{what}: cannot decode image: {e}") from None                     # as Pillow's plugins say
    return img


def _check_size(buf, what) -> None:
    """Refuse an image whose header claims more pixels than Pillow's limit, before OpenCV decodes
    it (which would allocate them all; a 30000 x 30000 PNG is a few KB)."""
    from PIL import Image
    try:
        Image.open(io.BytesIO(buf)).close()      # reads the header only
    except Image.DecompressionBombError as e:
        raise ValueError(f"{what}: {e}") from None
    except Exception:                            # a format Pillow does not know: OpenCV decides
        pass


def _imdecode(cv2, buf, flag, what):
    try:
        return cv2.imdecode(buf, flag)
    except cv2.error as e:          # its own checks (sizes past CV_IO_MAX_IMAGE_*) raise, not return None
        raise ValueError(f"{what}: not an image OpenCV can decode ({getattr(e, 'err', '') or e})") from None


def decode(buf: bytes, color=None, what="encoded image") -> np.ndarray:
    """Decode PNG/JPEG/... bytes to (C, H, W) uint8 BGR (Caffe's DecodeDatumToCVMat)."""
    cv2 = _cv2()
    if cv2 is not None:
        _check_size(buf, what)
        a = _imdecode(cv2, np.frombuffer(buf, np.uint8), _cv_flag(cv2, color), what)
        if a is None:
            raise ValueError(f"{what}: not an image OpenCV can decode")
        return _cv_chw(a)
    return _to_array(_open(io.BytesIO(buf), what), color)


def load(path, height=0, width=0, color=True) -> np.ndarray:
    """Read an image file, resized to height x width when both are set (Caffe's ReadImageToCVMat)."""
    cv2 = _cv2()
    if cv2 is not None:
        try:
            buf = np.fromfile(str(path), np.uint8)      # cv::imread's decoding, with the OS's error
        except OSError as e:
            raise ValueError(f"{path}: cannot read image: {e.strerror or e}") from None
        _check_size(buf.data, str(path))
        a = _imdecode(cv2, buf, _cv_flag(cv2, bool(color)), path) if buf.size else None
        if a is None:
            raise ValueError(f"{path}: not an image OpenCV can decode")
        if height > 0 and width > 0:
            a = cv2.resize(a, (width, height))          # INTER_LINEAR, as Caffe
        return _cv_chw(a)
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
