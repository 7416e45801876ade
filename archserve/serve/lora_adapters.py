"""The LoRA adapters a server serves, each under its own model name (vLLM's
``--lora-modules`` and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``).

An adapter is read and checked on a worker thread (a bad directory or a rank above
``--max-lora-rank`` is a 400 naming the problem), then handed to the engine between two
steps; requests name it in ``model``. Unloading forgets the name at once; requests already
running with the adapter finish with it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from archserve.engine.lora.request import LoRARequest
from archserve.serve.async_engine import AsyncEngine, EngineDeadError
from archserve.serve.errors import OpenAIError


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> list[LoRAModulePath]:
    """``--lora-modules`` values (each ``name=path``, several separated by spaces, or a
    JSON object with "name", "path" and optionally "base_model_name")."""
    modules = []
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            try:
                entry = json.loads(value)
                modules.append(LoRAModulePath(entry["name"], entry["path"],
                                              entry.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs 'name' and "
                                 f"'path' ({exc})") from None
            continue
        for item in value.split():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
            modules.append(LoRAModulePath(name, path))
    return modules


class ServedAdapters:
    def __init__(self, engine: AsyncEngine, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock: asyncio.Lock | None = None

    @property
    def enabled(self) -> bool:
        return self.engine.engine.lora is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` at start-up (before the engine thread runs); ValueError
        on the first that does not load."""
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in modules:
            request = self._request(module.name, module.path, False)
            request.base_model_name = module.base_model_name
            self.engine.engine.add_lora(request)
            self.by_name[module.name] = request

    async def load(self, name: str | None, path: str | None, load_inplace: bool = False) -> str:
        async with self._serialized():
            request = self._request(name, path, load_inplace)
            engine = self.engine.engine
            try:
                loaded = await asyncio.to_thread(engine.read_lora, request)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="lora_path") from None
            await self._on_engine(lambda: engine.add_read_lora(loaded, replace=load_inplace))
            self.by_name[request.lora_name] = request
            return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, name: str | None) -> str:
        async with self._serialized():
            if not name:
                raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.",
                                  param="lora_name")
            request = self.by_name.get(name)
            if request is None:
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404,
                                  param="lora_name")
            engine = self.engine.engine
            await self._on_engine(lambda: engine.remove_lora(request.lora_int_id))
            del self.by_name[name]
            return f"Success: LoRA adapter '{name}' removed successfully."

    def _request(self, name: str | None, path: str | None, load_inplace: bool) -> LoRARequest:
        """The request to load ``path`` as ``name`` (400 for what cannot be)."""
        if not self.enabled:
            raise OpenAIError("LoRA is not enabled: start the server with --enable-lora")
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_names:
            raise OpenAIError(f"'{name}' is the base model's name", param="lora_name")
        known = self.by_name.get(name)
        if known is not None and not load_inplace:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded. If you want "
                              f"to load the adapter in place, set 'load_inplace' to True.",
                              param="lora_name")
        if known is not None:
            return LoRARequest(name, known.lora_int_id, path, known.base_model_name)
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    async def _on_engine(self, fn) -> None:  # noqa: ANN001 - a callable of no arguments
        """``fn`` on the engine thread: a ValueError is a 400, a stopped engine a 503."""
        try:
            await self.engine.call(fn)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), 503, headers={"Retry-After": "5"}) from None

    def _serialized(self) -> asyncio.Lock:
        """One load or unload at a time (made on the server's event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock
