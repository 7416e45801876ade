"""The adapters an engine knows, their host copies and their GPU slots.

- An adapter is read once from its PEFT directory and placed in the slots' layout on the
  host (``LoadedLoRA``). The manager keeps up to ``max_cpu_loras`` of them, least recently
  used evicted first; a request holds its adapter's ``LoadedLoRA`` while it runs, so an
  evicted adapter's matrices stay alive exactly as long as a request still needs them, and
  the next request for it reads the directory again.
- A step's adapters are copied into the layers' slots (``max_loras`` of them, the
  scheduler admits no more distinct adapters at once): an adapter already in a slot stays
  there, a new one takes a free slot or the least recently used slot no token of the step
  needs. The copy is queued on the device's stream, behind the steps in flight.
- ``cache_key`` names an adapter's contents (its id, directory and weights file's size and
  time): the prefix cache keys its blocks with it, so no adapter reuses KV computed under
  another, nor under an earlier version of itself.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from archserve.engine.lora.layout import LoRALayout, PlacedMatrices
from archserve.engine.lora.peft_adapter import read_peft_adapter
from archserve.engine.lora.request import LoRARequest
from archserve.kernels.lora.interface import NO_SLOT


@dataclass(eq=False)
class LoadedLoRA:
    """An adapter read and placed for this model, ready to copy into a slot."""

    request: LoRARequest
    placed: dict[int, PlacedMatrices] = field(repr=False)
    rank: int
    target_modules: list[str]
    cache_key: bytes

    @property
    def id(self) -> int:
        return self.request.lora_int_id


def adapter_cache_key(request: LoRARequest, path: str, weights_file: str) -> bytes:
    stat = os.stat(os.path.join(path, weights_file))
    digest = hashlib.sha256(f"lora\0{request.lora_int_id}\0{path}\0{stat.st_size}\0"
                            f"{stat.st_mtime_ns}".encode())
    return digest.digest()


class LoRAManager:
    def __init__(self, layout: LoRALayout, max_loras: int, max_cpu_loras: int,
                 max_lora_rank: int) -> None:
        self.layout = layout
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self._host: OrderedDict[int, LoadedLoRA] = OrderedDict()   # by id, LRU first
        self._slot_keys: list[bytes | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((s, None)
                                                            for s in range(max_loras))
        self.slot_loads = 0          # adapters copied into a slot (for tests and metrics)

    # -- the host side -------------------------------------------------------------------
    def read(self, request: LoRARequest) -> LoadedLoRA:
        """Read and place ``request``'s adapter (ValueError on a bad one). Touches no
        state: safe on another thread than the engine's."""
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has no path to load from")
        adapter = read_peft_adapter(request.lora_path, self.max_lora_rank)
        placed = self.layout.place(adapter)
        return LoadedLoRA(request, placed, adapter.rank, adapter.target_modules,
                          adapter_cache_key(request, adapter.path, adapter.weights_file))

    def add(self, loaded: LoadedLoRA, replace: bool = False) -> None:
        """Keep ``loaded`` on the host (vLLM's add_lora). Its id must not name another
        adapter already loaded, unless ``replace``."""
        known = self._host.get(loaded.id)
        if known is not None and not replace and not _same_adapter(known.request,
                                                                  loaded.request):
            raise ValueError(_id_conflict(known.request, loaded.request))
        self._host[loaded.id] = loaded
        self._host.move_to_end(loaded.id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def get(self, request: LoRARequest) -> LoadedLoRA:
        """The loaded adapter of ``request``, read from its directory if the host holds it
        no more (ValueError on a bad adapter, or on an id another adapter holds)."""
        known = self._host.get(request.lora_int_id)
        if known is not None:
            if not _same_adapter(known.request, request):
                raise ValueError(_id_conflict(known.request, request))
            self._host.move_to_end(request.lora_int_id)
            return known
        loaded = self.read(request)
        self.add(loaded)
        return loaded

    def remove(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (requests running with it finish with it)."""
        return self._host.pop(lora_id, None) is not None

    def list_ids(self) -> list[int]:
        return list(self._host)

    # -- the device side -----------------------------------------------------------------
    def slots_for(self, adapters: Sequence[LoadedLoRA | None]) -> list[int]:
        """The slot of each entry (NO_SLOT for None), copying adapters that hold none into
        one first. At most ``max_loras`` distinct adapters (the scheduler's admission)."""
        needed = {a.cache_key: a for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters, above max_loras "
                               f"{self.max_loras}")
        slot_of = {key: s for s, key in enumerate(self._slot_keys) if key in needed}
        for key, adapter in needed.items():
            if key not in slot_of:
                free = [s for s in self._slot_use if self._slot_keys[s] is None]
                slot = free[0] if free else next(s for s in self._slot_use
                                                 if self._slot_keys[s] not in needed)
                self.layout.load_slot(slot, adapter.placed)
                self._slot_keys[slot] = key
                slot_of[key] = slot
                self.slot_loads += 1
            self._slot_use.move_to_end(slot_of[key])
        return [NO_SLOT if a is None else slot_of[a.cache_key] for a in adapters]


def _same_adapter(a: LoRARequest, b: LoRARequest) -> bool:
    return os.path.abspath(a.lora_path) == os.path.abspath(b.lora_path) if b.lora_path else True


def _id_conflict(known: LoRARequest, new: LoRARequest) -> str:
    return (f"LoRA id {new.lora_int_id} is already loaded from {known.lora_path!r} (name "
            f"{known.lora_name!r}); give the adapter at {new.lora_path!r} another id")
