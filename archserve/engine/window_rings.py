"""WindowRings: the window rings of a model that keeps its sliding-window keys per sequence
(DeepSeek V4: kernels/compressed_attention/layout.py), and their snapshots for the prefix
cache.

A running sequence holds one ring of ``ring_rows`` rows (a token's slot is the ring's first
row + position % ring_rows: ``Sequence.ring``). A ring after a step that ended at a block
boundary P holds the window before P, which no block keeps; so the block pool copies it into
a spare ring, a snapshot of the block that ends at P, and a later sequence whose cached
prefix ends at P starts from a copy of that snapshot. Snapshots are a cache: the least
recently used one gives its ring up when a sequence needs one, and a block's snapshot goes
when the block leaves the prefix cache.

The copies are bookkeeping here: ``drain_copies`` hands them, in order, to the next step the
scheduler plans (``SchedulerOutput.ring_copies``), and the engine has the model runner make
them before that step's forward (engine/model_runner.py ``copy_rings``). A snapshot
recorded when a step is committed is thus copied after that step's forward and before any
later one, which is when the ring holds the window it names.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from archserve.engine.sequence import Sequence


class WindowRings:
    def __init__(self, num_rings: int, ring_rows: int) -> None:
        if num_rings < 1 or ring_rows < 1:
            raise ValueError(f"need num_rings >= 1 and ring_rows >= 1, got {num_rings}, "
                             f"{ring_rows}")
        self.num_rings, self.ring_rows = num_rings, ring_rows
        self._free: deque[int] = deque(range(num_rings))
        self._snapshots: OrderedDict[int, int] = OrderedDict()   # block id -> ring, LRU first
        self._copies: list[tuple[int, int]] = []                 # (source ring, target ring)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def can_take(self) -> bool:
        return bool(self._free or self._snapshots)

    def take(self, seq: Sequence, restore_from: int | None = None) -> None:
        """Give ``seq`` a ring (evicting the least recently used snapshot where none is
        free), holding a copy of block ``restore_from``'s snapshot if given."""
        source = self._snapshots.get(restore_from) if restore_from is not None else None
        if source is not None:
            self._snapshots.move_to_end(restore_from)
        ring = self._pop()
        if source is not None:
            self._copies.append((source, ring))
        seq.ring = (ring * self.ring_rows, self.ring_rows)

    def give_back(self, seq: Sequence) -> None:
        if seq.ring is not None:
            self._free.append(seq.ring[0] // self.ring_rows)
            seq.ring = None

    def has_snapshot(self, block_id: int) -> bool:
        return block_id in self._snapshots

    def snapshot(self, block_id: int, seq: Sequence) -> None:
        """Keep what ``seq``'s ring holds after the step being committed as ``block_id``'s
        snapshot (no-op where it has one, or where every ring runs a sequence)."""
        if block_id in self._snapshots or seq.ring is None:
            return
        if not self._free:
            if not self._snapshots:
                return
            self._free.append(self._snapshots.popitem(last=False)[1])
        ring = self._free.popleft()
        self._snapshots[block_id] = ring
        self._copies.append((seq.ring[0] // self.ring_rows, ring))

    def forget(self, block_id: int) -> None:
        """``block_id`` left the prefix cache: its snapshot's ring is free again (a copy into
        it that is still queued is dropped: the ring may be handed out before it runs)."""
        ring = self._snapshots.pop(block_id, None)
        if ring is not None:
            self._copies = [copy for copy in self._copies if copy[1] != ring]
            self._free.append(ring)

    def forget_all(self) -> None:
        self._free.extend(self._snapshots.values())
        self._snapshots.clear()

    def drain_copies(self) -> list[tuple[int, int]]:
        """The ring copies recorded since the last call, oldest first."""
        copies, self._copies = self._copies, []
        return copies

    def _pop(self) -> int:
        if not self._free:
            self._free.append(self._snapshots.popitem(last=False)[1])
        return self._free.popleft()
