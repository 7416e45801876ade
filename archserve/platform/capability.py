"""Compute capability: the one number every hardware rule is written against."""

from __future__ import annotations

from dataclasses import dataclass
from functools import total_ordering


@total_ordering
@dataclass(frozen=True)
class Capability:
    """A CUDA-style compute capability (major, minor), e.g. Capability(9, 0) for SM90.

    Rules compare capabilities (``cap >= SM80``) or families (``cap.family == 100``),
    never GPU names. SM100 (data-centre Blackwell) and SM120 (RTX Blackwell) are
    different families: a kernel built for one does not run on the other.
    """

    major: int
    minor: int

    @classmethod
    def parse(cls, text: str | int | tuple[int, int]) -> Capability:
        """Accept ``(9, 0)``, ``90``, ``"90"``, ``"9.0"``, ``"sm_90"``, ``"sm90a"``."""
        if isinstance(text, Capability):
            return text
        if isinstance(text, tuple):
            return cls(int(text[0]), int(text[1]))
        s = str(text).strip().lower().removeprefix("sm").removeprefix("_").rstrip("af")
        if "." in s:
            major, minor = s.split(".", 1)
            return cls(int(major), int(minor))
        if not s.isdigit() or len(s) < 2:
            raise ValueError(f"not a compute capability: {text!r}")
        return cls(int(s[:-1]), int(s[-1]))

    def to_int(self) -> int:
        """12.1 -> 121, 9.0 -> 90."""
        return self.major * 10 + self.minor

    @property
    def family(self) -> int:
        """The architecture family: 10.3 -> 100, 12.1 -> 120, 9.0 -> 90."""
        return self.major * 10

    @property
    def arch(self) -> str:
        """The compiler target name, e.g. ``sm_90``."""
        return f"sm_{self.to_int()}"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Capability):
            return NotImplemented
        return (self.major, self.minor) < (other.major, other.minor)

    def __str__(self) -> str:
        return f"SM{self.to_int()}"


SM60 = Capability(6, 0)
SM61 = Capability(6, 1)
SM70 = Capability(7, 0)
SM75 = Capability(7, 5)
SM80 = Capability(8, 0)
SM86 = Capability(8, 6)
SM89 = Capability(8, 9)
SM90 = Capability(9, 0)
SM100 = Capability(10, 0)
SM103 = Capability(10, 3)
SM110 = Capability(11, 0)
SM120 = Capability(12, 0)
SM121 = Capability(12, 1)
