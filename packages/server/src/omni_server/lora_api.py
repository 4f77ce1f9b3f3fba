"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: vLLM's runtime LoRA routes.

They answer only with ``--enable-lora --allow-runtime-lora-updating`` (vLLM gates them with the
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` environment variable; here it is a flag, declared with the others), otherwise
404 saying which flags turn them on. The engine reads and checks the file (``omni_models.lora_files``) between two
iterations: a bad file is a 400 naming ``lora_path`` and changes nothing; the server keeps serving either way.
Success is vLLM's plain-text answer. An unloaded adapter takes no new requests; those running with it finish
with it.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from omni_server.config import LoRAModule
from omni_server.errors import APIError, invalid_field
from omni_server.schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def lora_router(state) -> APIRouter:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
    router = APIRouter()

    def check_enabled() -> None:
        config = state.config
        if not (config.enable_lora and config.allow_runtime_lora_updating):
            flags = (("--enable-lora", config.enable_lora), ("--allow-runtime-lora-updating", False))
            missing = [flag for flag, given in flags if not given]
            raise APIError(
                404,
                f"runtime LoRA updating is off; start the server with {' '.join(missing)}",
                type="not_found_error",
                code="runtime_lora_updating_disabled",
            )
        state.info()  # 503 while the engine is not ready

    async def update(change: LoRAModule | str) -> float:
        result = await state.client.update_lora(change)
        if result.error is not None:
            raise APIError.from_request_error(result.error)
        return result.load_s

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        check_enabled()
        name = body.lora_name
        if name == state.config.model_name:
            raise invalid_field("lora_name", f"{name!r} is the base model's name", code="lora_name_taken")
        if any(a.name == name for a in state.adapters()):
            raise invalid_field(
                "lora_name", f"a LoRA adapter named {name!r} is loaded; unload it first", code="lora_name_taken"
            )
        load_s = await update(LoRAModule(name=name, path=body.lora_path))
        return PlainTextResponse(
            f"Success: LoRA adapter '{name}' added successfully.", headers={"x-lora-load-seconds": f"{load_s:.4f}"}
        )

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        check_enabled()
        name = body.lora_name
        if not any(a.name == name for a in state.adapters()):
            raise APIError(
                404,
                f"no LoRA adapter named {name!r} is loaded",
                type="not_found_error",
                param="lora_name",
                code="lora_not_found",
            )
        await update(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
