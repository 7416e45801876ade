"""Decision: one visible choice archserve made on the user's behalf (a leaf module)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Decision:
    """``requested`` became ``chosen`` because of ``reason`` (equal when nothing changed)."""

    what: str          # "dtype", "kv_cache_dtype", "quantization", ...
    requested: str
    chosen: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)
