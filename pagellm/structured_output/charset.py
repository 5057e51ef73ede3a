"""Sets of Unicode code points as sorted, disjoint (low, high) ranges: what one regex or grammar
character may be, as far as the complexity check needs it (JavaScript's classes, as xgrammar reads
regexes: `\\d` and `\\w` are ASCII, `\\s` includes Unicode spaces)."""
from __future__ import annotations

CharSet = tuple[tuple[int, int], ...]

MAX_CODE_POINT = 0x10FFFF
EMPTY: CharSet = ()
ANY: CharSet = ((0, MAX_CODE_POINT),)


def of(*ranges: tuple[int, int]) -> CharSet:
    """The union of `ranges` (inclusive, any order, overlapping or not)."""
    merged: list[tuple[int, int]] = []
    for low, high in sorted(r for r in ranges if r[0] <= r[1]):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def char(c: str) -> CharSet:
    return ((ord(c), ord(c)),)


def union(*sets: CharSet) -> CharSet:
    present = [s for s in sets if s]
    if len(present) <= 1 or all(s == present[0] for s in present):
        return present[0] if present else EMPTY
    return of(*(r for s in present for r in s))


def complement(s: CharSet) -> CharSet:
    gaps, start = [], 0
    for low, high in s:
        if low > start:
            gaps.append((start, low - 1))
        start = high + 1
    if start <= MAX_CODE_POINT:
        gaps.append((start, MAX_CODE_POINT))
    return tuple(gaps)


def intersects(a: CharSet, b: CharSet) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


DIGIT = of((0x30, 0x39))
WORD = of((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = of((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
           (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
CLASS_ESCAPES = {"d": DIGIT, "D": complement(DIGIT), "w": WORD, "W": complement(WORD), "s": SPACE,
                 "S": complement(SPACE)}
"""`\\d`, `\\w`, `\\s` and their complements."""
