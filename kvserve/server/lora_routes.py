"""LoRA adapters at run time, as vLLM's routes: POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, behind the API key
like every route (installed with --enable-lora).

The engine thread loads and unloads (between two steps), so no step sees half an adapter. A
malformed adapter is a 400 naming lora_path, and nothing of it is installed; more than
--max-loras adapters is a 400. Unloading an adapter that a request in flight runs with is
refused with a 400 (the client retries once those requests have finished); an adapter not
loaded is a 404.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.errors import BadRequest, NotFound
from kvserve.server.serving import ServerState

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


def install_lora_routes(app: FastAPI, state: ServerState) -> None:
    """The two routes, and the adapters loaded at start (--lora-modules) in `state`."""
    engine = state.engine
    state.lora_adapters.update(engine.core.lora_adapters())

    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name, path = body.lora_name, body.lora_path
        if name in state.served_model_names:
            raise BadRequest(f"{name!r} is the base model's name: choose another", "lora_name")
        if name in state.lora_adapters:
            raise BadRequest(
                f"LoRA adapter {name!r} is already loaded: unload it first", "lora_name"
            )
        try:
            await engine.call(lambda core: core.load_lora(name, path))
        except ValueError as e:
            raise BadRequest(str(e), "lora_path") from None
        state.lora_adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        try:
            await engine.call(lambda core: core.unload_lora(name))
        except KeyError as e:
            raise NotFound(e.args[0], "lora_name", code="model_not_found") from None
        except ValueError as e:
            raise BadRequest(str(e), "lora_name") from None
        state.lora_adapters.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.post("/v1/load_lora_adapter")(load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(unload_lora_adapter)
