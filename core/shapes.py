"""Fixed shapes for training (`shape_buckets`): each packed micro-batch's dimensions rounded up to a few buckets, so
that an epoch shows a handful of distinct shapes instead of one per step. A new shape costs a GPU step twice over:
cuBLAS and the caching allocator look each one up afresh on the host (campaign v2: 66 us of host time in each
`aten::mm`, every step's row a new length), and a compiled block (compile_blocks) compiles a graph per shape.

The buckets are a short geometric series: every multiple of `unit` while the step is at most 1/8 of the value, then
each bucket the largest multiple of `unit` at most 1.125 times the one before (tokens: 128, 256, ..., 1152, 1280,
1408, 1536, 1664, 1792, 2048, 2304, 2560, ...). A dimension padded to its bucket grows by at most 12.5% (about 6%
on average); the run prints what its epoch pays (reporting.data_report.shape_report). Padding is what the layouts
already pad with: tail tokens that attend only to themselves and are never scored, empty rows, and kept positions
that repeat a row's last. Kept positions are bucketed from 16, rows from 1 (each count up to 16, then 18, 20, ...)."""

from dataclasses import dataclass

# the series' growth: a dimension's padding is at most 1 / 8 of it
GROWTH = 1.125


def bucket(n: int, unit: int, growth: float = GROWTH) -> int:
    """The smallest value of the series that is at least n: multiples of `unit`, from `unit`, each the largest
    multiple at most `growth` times the one before (or the next multiple, while that is more)."""
    value = unit
    while value < n:
        value = max(value + unit, int(value * growth) // unit * unit)
    return value


@dataclass(frozen=True)
class Shapes:
    """How a packed micro-batch's dimensions are rounded: its rows R, its row length T (to a multiple of `multiple`,
    FlexAttention's tile or a sequence-parallel group's size, whether or not it is bucketed) and its kept positions
    per row K. Without buckets only T's multiple applies."""

    bucketed: bool = False
    multiple: int = 1

    def budget(self, longest: int) -> int:
        """A packed row's default token budget, from the longest segment: its bucket where bucketed."""
        return self.length(longest) if self.bucketed else longest

    def rows(self, n: int) -> int:
        return bucket(n, 1) if self.bucketed else n

    def length(self, n: int) -> int:
        n = bucket(n, 128) if self.bucketed else n
        return -(-n // self.multiple) * self.multiple

    def kept(self, n: int) -> int:
        return bucket(n, 16) if self.bucketed else n
