"""8-bit KV caches: the encodings, quantisation with scales, and calibration.

A quantized cache stores each element of K and V as one byte, ``code``, with a float32
``scale``; its value is ``decode(code) * scale``. Three encodings (``FORMATS``):

* ``"int8"``: symmetric integers, decode(c) = c for c in [-127, 127] (-128 is never written);
* ``"float8_e4m3fn"``: 1 sign, 4 exponent (bias 7), 3 mantissa bits, subnormals, no
  infinities, NaN = S.1111.111 (torch.float8_e4m3fn; largest finite 448);
* ``"float8_e5m2"``: 1 sign, 5 exponent (bias 15), 2 mantissa bits: the top byte of an IEEE
  half (torch.float8_e5m2; largest finite 57344, infinities and NaNs).

Quantising x: y = float32(x) / float32(scale), then to the nearest code, ties to even
(round-to-nearest-even), saturating at +-QMAX (infinities included); NaN stays NaN in the
float8 formats and becomes 0 in int8. Scales come in two granularities:

* **static, per kv head**: shape (heads_kv,), from :func:`calibrate_scales` on sample K/V
  (the absolute maximum, or a percentile of |x| to clip outliers);
* **dynamic, per (token, kv head)**: shaped like the cache without its last dimension,
  written at append time next to the cache: scale = max |x| over the row's finite entries
  / QMAX (1 for a row of zeros), so every row uses the whole code range.

NumPy holds int8 caches as int8 and float8 caches as uint8 (these bytes), or as ml_dtypes'
float8 arrays; torch as torch.int8 / torch.float8_e4m3fn / torch.float8_e5m2.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FORMATS", "QMAX", "CODES", "decode_table", "as_codes", "quantize", "dequantize",
           "dynamic_scales", "calibrate_scales"]

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")
#: Largest finite magnitude of each encoding: a dynamic scale maps a row's max |x| there.
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The kernels' names for the formats (csrc/fmha/params.h, KvCode).
CODES = {"int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}


def _check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def decode_table(fmt: str) -> np.ndarray:
    """float64 (256,): the value of each byte 0..255 (read as uint8) in this encoding."""
    fmt = _check_format(fmt)
    c = np.arange(256)
    if fmt == "int8":
        return c.astype(np.uint8).view(np.int8).astype(np.float64)
    ebits, bias = (4, 7) if fmt == "float8_e4m3fn" else (5, 15)
    mbits = 7 - ebits
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
    normal = (1.0 + m / 2.0 ** mbits) * 2.0 ** (e - bias)
    value = sign * np.where(e == 0, m / 2.0 ** mbits * 2.0 ** (1 - bias), normal)
    if fmt == "float8_e4m3fn":
        value[(c & 0x7F) == 0x7F] = np.nan
    else:
        top = e == (1 << ebits) - 1
        value[top] = np.where(m[top] == 0, sign[top] * np.inf, np.nan)
    return value


def as_codes(cache) -> np.ndarray:
    """The bytes of a NumPy cache as uint8 (int8 and ml_dtypes float8 arrays are viewed)."""
    return np.asarray(cache).view(np.uint8)


def dequantize(codes, fmt: str, scale) -> np.ndarray:
    """float64 values of codes (NumPy uint8 / int8 / float8 bytes, (..., dim)) times scale,
    which broadcasts against codes.shape[:-1]: (heads,) static scales, (..., heads) dynamic
    ones, or a number."""
    return decode_table(fmt)[as_codes(codes)] * np.asarray(scale, dtype=np.float64)[..., None]


def _positive_codes(fmt):
    """The finite non-negative values of a float8 encoding, ascending, and their codes."""
    table = decode_table(fmt)[:128]
    codes = np.flatnonzero(np.isfinite(table))
    return table[codes], codes


def quantize(x, fmt: str, scale) -> np.ndarray:
    """Codes (uint8; int8 for "int8") of x / scale (x: (..., dim)), rounded to nearest even,
    saturating; scale broadcasts against x.shape[:-1] as in :func:`dequantize`."""
    fmt = _check_format(fmt)
    y = np.asarray(x, dtype=np.float32) / np.asarray(scale, dtype=np.float32)[..., None]
    if fmt == "int8":
        y = np.where(np.isnan(y), 0.0, np.clip(y, -127.0, 127.0))
        return np.rint(y).astype(np.int8)
    vals, codes = _positive_codes(fmt)
    a = np.minimum(np.abs(y.astype(np.float64)), vals[-1])
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (codes[i] % 2 == 0))
    out = np.where(up, codes[i], codes[i - 1]).astype(np.uint8)
    out |= np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(y), np.uint8(0x7F), out).astype(np.uint8)


def dynamic_scales(x, fmt: str) -> np.ndarray:
    """float32 per-row scales of x (..., dim): max |x| over each row's finite entries / QMAX,
    1 where that is 0 (what the kernels write at append time)."""
    fmt = _check_format(fmt)
    a = np.abs(np.asarray(x, dtype=np.float32))
    top = np.where(np.isfinite(a), a, 0).max(axis=-1, initial=0)
    s = (top / np.float32(QMAX[fmt])).astype(np.float32)
    return np.where(s > 0, s, np.float32(1)).astype(np.float32)


def calibrate_scales(samples, fmt: str, *, method: str = "absmax",
                     percentile: float = 99.99) -> np.ndarray:
    """Static per-kv-head scales (float32 (heads_kv,)) from sample keys or values
    (..., heads_kv, head_dim): each head's max |x| ("absmax": nothing saturates) or its
    ``percentile`` of |x| ("percentile": outliers beyond it saturate, the rest get finer
    steps), divided by the format's QMAX. Torch tensors and NumPy arrays."""
    fmt = _check_format(fmt)
    if hasattr(samples, "detach"):
        samples = samples.detach().float().cpu().numpy()
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim < 2:
        raise ValueError(f"samples: expected (..., heads_kv, head_dim), got shape {x.shape}")
    a = np.abs(np.moveaxis(x, -2, 0).reshape(x.shape[-2], -1))
    a = np.where(np.isfinite(a), a, 0)
    if method == "absmax":
        top = a.max(axis=1, initial=0)
    elif method == "percentile":
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile: expected (0, 100], got {percentile!r}")
        top = np.percentile(a, percentile, axis=1)
    else:
        raise ValueError(f"method: expected 'absmax' or 'percentile', got {method!r}")
    s = (top / QMAX[fmt]).astype(np.float32)
    return np.where(s > 0, s, np.float32(1)).astype(np.float32)
