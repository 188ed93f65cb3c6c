"""A minimal PNG encoder (8-bit RGB, zlib) and the colour scales of the heatmaps, so that
an HTML report carries its pictures inline without a plotting library."""

from __future__ import annotations

import struct
import zlib

import numpy as np

NOT_COMPARED = (200, 200, 200)
"""The colour of a cell with nothing compared (light grey)."""
INFINITE = (40, 0, 60)
"""The colour of an infinite error: a NaN or Inf on one side only, or 0 against non-0."""
_STOPS = np.array(
    [
        (0.0, 255, 255, 255),
        (0.25, 255, 237, 160),
        (0.5, 254, 178, 76),
        (0.75, 240, 59, 32),
        (1.0, 128, 0, 38),
    ]
)
REL_DECADES = 6
"""The relative-error scale spans ``10**-REL_DECADES`` (pale) to 1 and above (dark)."""


def _ramp(t: np.ndarray) -> np.ndarray:
    """Colours ``[..., 3]`` of positions ``t`` in 0..1 along white, yellow, orange, red."""
    t = np.clip(t, 0.0, 1.0)
    return np.stack(
        [np.interp(t, _STOPS[:, 0], _STOPS[:, channel]) for channel in (1, 2, 3)], axis=-1
    ).astype(np.uint8)


def rel_error_position(values: np.ndarray) -> np.ndarray:
    """Where relative errors sit on the scale: 0 for no error, then ``10**-6 .. 1`` on
    a log scale from just above 0 to 1 (NaN and Inf left as they are)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (np.log10(values) + REL_DECADES) / REL_DECADES
    t = np.where(values > 0, np.clip(t, 0.05, 1.0), 0.0)
    return np.where(np.isfinite(values), t, values)


RATIO_DECADES_WITHIN = 3
"""The calm half of the tolerance-ratio scale spans ``10**-3`` (palest green) to 1."""
RATIO_DECADES_OVER = 2
"""The red half spans just over 1 (orange-red) to ``10**2`` and above (darkest red)."""
WITHIN_TOLERANCE = np.array(
    [
        (0.0, 247, 251, 246),
        (0.5, 199, 233, 192),
        (1.0, 116, 196, 118),
    ]
)
"""Greens: a ratio from 0 (no error, near white) up to 1 (the tolerance, a calm green)."""
OVER_TOLERANCE = np.array(
    [
        (0.0, 251, 106, 74),
        (0.5, 222, 45, 38),
        (1.0, 128, 0, 38),
    ]
)
"""Reds: a ratio just over 1 (already a clear red, no green or yellow near it) up to 100."""


def _stops(t: np.ndarray, stops: np.ndarray) -> np.ndarray:
    t = np.clip(t, 0.0, 1.0)
    return np.stack(
        [np.interp(t, stops[:, 0], stops[:, channel]) for channel in (1, 2, 3)], axis=-1
    )


def ratio_colours(ratios: np.ndarray) -> np.ndarray:
    """RGB ``[rows, cols, 3]`` of tolerance ratios ``|c - p| / (atol + rtol |p|)``
    ``[rows, cols]``: up to 1 (within the tolerance) greens on a log scale from
    ``10**-RATIO_DECADES_WITHIN``, above 1 reds on a log scale up to
    ``10**RATIO_DECADES_OVER``; 0 near white, NaN not compared (grey), Inf infinite."""
    values = np.asarray(ratios, dtype=np.float64)
    finite = np.nan_to_num(values, nan=0.0, posinf=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        decades = np.log10(np.where(finite > 0, finite, 1.0))
    within = np.where(
        finite > 0, np.clip((decades + RATIO_DECADES_WITHIN) / RATIO_DECADES_WITHIN, 0.02, 1.0), 0.0
    )
    over = decades / RATIO_DECADES_OVER
    out = np.where(
        (finite > 1)[..., None], _stops(over, OVER_TOLERANCE), _stops(within, WITHIN_TOLERANCE)
    ).astype(np.uint8)
    out[np.isnan(values)] = NOT_COMPARED
    out[np.isposinf(values)] = INFINITE
    return out


def colours(positions: np.ndarray) -> np.ndarray:
    """RGB ``[rows, cols, 3]`` of scale positions ``[rows, cols]`` (NaN: not compared,
    Inf: infinite)."""
    out = _ramp(np.nan_to_num(positions, nan=0.0, posinf=1.0))
    out[np.isnan(positions)] = NOT_COMPARED
    out[np.isposinf(positions)] = INFINITE
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def encode_png(rgb: np.ndarray) -> bytes:
    """The PNG file of an RGB image ``[height, width, 3]`` of uint8.

    Args:
        rgb: The image, row by row from the top.

    Returns:
        The PNG file's bytes (8-bit RGB, zlib-compressed).

    """
    height, width, _ = rgb.shape
    rows = np.concatenate(
        [np.zeros((height, 1), dtype=np.uint8), rgb.reshape(height, width * 3)], axis=1
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)),
            _chunk(b"IEND", b""),
        )
    )
