"""The static plan of context-parallel attention: which kernel calls one device makes on the
q and k/v blocks it holds, decided in Python from the layouts, the device indices and the mask.

A device holds q rows and k/v rows whose absolute sequence positions are known when tracing (they
depend on the layout and on device indices, not on data). The single-device kernel takes a
rectangle of q rows and k rows and a window bottom-right aligned on that rectangle, so every
mask here is first written as a band on local indices, ``lo <= j - r <= hi`` (q row r, k row j of
the local buffers), and then cut into as few rectangles ("tiles") as the kernel can express,
trimmed to the rows and keys that see anything: blocks the mask hides produce no call at all.
"""

from __future__ import annotations

import dataclasses
import itertools

# An unbounded side of a band; large enough that no sum of sizes reaches it, small enough for
# exact integer arithmetic.
INF = 1 << 62


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows ``[start, start + length)`` of a local buffer hold absolute positions
    ``[pos, pos + length)``."""

    start: int
    pos: int
    length: int


@dataclasses.dataclass(frozen=True)
class Tile:
    """One kernel call: q rows ``[q0, q1)`` against k/v rows ``[k0, k1)`` with the window
    ``(left, right)`` as `flash_attention` takes it (bottom-right aligned on the tile, -1 for an
    unbounded side)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int


@dataclasses.dataclass(frozen=True)
class _Band:
    """The pairs (r, j) of rows ``[r0, r1)`` x keys ``[c0, c1)`` with lo <= j - r <= hi."""

    r0: int
    r1: int
    c0: int
    c1: int
    lo: int
    hi: int

    def visible_box(self):
        """(r0, r1, c0, c1) of the rows and keys that see / are seen by anything, or None."""
        if self.lo > self.hi:
            return None
        r0, r1 = max(self.r0, self.c0 - self.hi), min(self.r1, self.c1 - self.lo)
        if r0 >= r1:
            return None
        c0, c1 = max(self.c0, r0 + self.lo), min(self.c1, r1 + self.hi)
        return (r0, r1, c0, c1) if c0 < c1 else None

    def clip(self, box):
        r0, r1, c0, c1 = box
        return _Band(
            max(self.r0, r0), min(self.r1, r1), max(self.c0, c0), min(self.c1, c1), self.lo, self.hi
        )

    def empty_rect(self) -> bool:
        return self.r0 >= self.r1 or self.c0 >= self.c1

    def same_pairs(self, lo: int, hi: int) -> bool:
        """Does the band (lo, hi) select the same pairs of this rectangle as (self.lo, self.hi)?
        On the rectangle, j - r ranges over [dmin, dmax]; bands equal after clamping to it."""
        dmin, dmax = self.c0 - (self.r1 - 1), self.c1 - 1 - self.r0

        def clamped(a, b):
            a, b = max(a, dmin), min(b, dmax)
            return (a, b) if a <= b else None

        return clamped(self.lo, self.hi) == clamped(lo, hi)


def band(q: Segment, k: Segment, left: int, right: int) -> _Band:
    """The mask of q segment x k segment as a band on local indices. A key at position p_k is
    seen by a query at p_q iff -left <= p_k - p_q <= right (-1: unbounded side)."""
    shift = (k.pos - k.start) - (q.pos - q.start)  # p_k - p_q = (j - r) + shift
    lo = -INF if left < 0 else -left - shift
    hi = INF if right < 0 else right - shift
    return _Band(q.start, q.start + q.length, k.start, k.start + k.length, lo, hi)


def _tile(box, lo: int, hi: int) -> Tile:
    """The kernel call for band (lo, hi) on `box`, trimmed to what is visible. The trimmed
    tile's last row sees its last key, so both window sides come out >= 0 (or unbounded)."""
    r0, r1, c0, c1 = _Band(*box, lo, hi).visible_box()
    sq, sk = r1 - r0, c1 - c0
    # Tile-local j' - r' = (j - r) - (c0 - r0); the kernel's band is
    # [sk - sq - left, sk - sq + right].
    left = c1 - r1 - lo
    right = hi - (c1 - r1)
    assert left >= 0 and right >= 0, (box, lo, hi)
    left = -1 if left >= sk - 1 else left  # covers every key of the tile: unbounded
    right = -1 if right >= sq - 1 else right
    return Tile(r0, r1, c0, c1, left, right)


def _region(bands, box):
    """A single tile for the bands' pairs inside `box`, or [] when none is visible, or None
    when no one band on the box selects exactly those pairs."""
    parts = [b.clip(box) for b in bands]
    parts = [p for p in parts if not p.empty_rect()]
    boxes = [bx for bx in (p.visible_box() for p in parts) if bx is not None]
    if not boxes:
        return []
    vis = (
        min(b[0] for b in boxes),
        max(b[1] for b in boxes),
        min(b[2] for b in boxes),
        max(b[3] for b in boxes),
    )
    parts = [p.clip(vis) for p in parts]
    parts = [p for p in parts if not p.empty_rect()]
    los = sorted({-INF, *(p.lo for p in parts)})
    his = sorted({INF, *(p.hi for p in parts)})
    for lo, hi in itertools.product(los, his):
        if all(p.same_pairs(lo, hi) for p in parts):
            return [_tile(vis, lo, hi)]
    return None


def plan(q_segments, k_segments, left: int, right: int) -> tuple[Tile, ...]:
    """Tiles covering exactly the visible (q row, k row) pairs of the local buffers, each pair
    once: one tile for the whole buffers where one band expresses the mask, else one per q
    segment, else one per (q segment, k segment)."""
    grid = [[band(q, k, left, right) for k in k_segments] for q in q_segments]
    everything = [b for row in grid for b in row]
    whole = (
        min(q.start for q in q_segments),
        max(q.start + q.length for q in q_segments),
        min(k.start for k in k_segments),
        max(k.start + k.length for k in k_segments),
    )
    tiles = _region(everything, whole)
    if tiles is not None:
        return tuple(tiles)
    out = []
    for q, row in zip(q_segments, grid, strict=True):
        rows = _region(row, (q.start, q.start + q.length, whole[2], whole[3]))
        if rows is None:
            rows = [t for b in row for t in _region([b], (b.r0, b.r1, b.c0, b.c1))]
        out.extend(rows)
    return tuple(out)


def segments(layout: str, device: int, n: int, local_len: int) -> tuple[Segment, ...]:
    """The positions a device holds: "natural" (device d: block d of n) or "zigzag" (the
    sequence cut into 2n chunks, device d holding chunks d and 2n-1-d, in that order)."""
    if layout == "natural":
        return (Segment(0, device * local_len, local_len),)
    c = local_len // 2
    return (Segment(0, device * c, c), Segment(c, (2 * n - 1 - device) * c, c))
