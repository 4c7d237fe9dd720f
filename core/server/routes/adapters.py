"""vLLM's run-time LoRA routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
on the app only with ``allow_runtime_lora`` (``--allow-runtime-lora``) and, like every route but
``/health``, behind the API key when one is set. Loading reads the folder and unloading waits for
the adapter's requests in flight, so both run in a worker thread.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from poolrunner.core.errors import InvalidRequestError, ModelLoadError
from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.routes.dependencies import Served

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: p.LoadLoraAdapterRequest, served: Served) -> str:
    """Load the PEFT folder ``lora_path`` as adapter ``lora_name`` of model ``model`` (default: the
    first); a request then selects it by ``model: lora_name``. 400 for a folder refused (naming
    the file and field or tensor) or a name taken. The least recently used idle adapter makes
    room; when every resident one is busy, the folder is checked and loaded when a request names it."""
    service = served.pick(body.model)
    if body.lora_name in {name for s in served.services for name in s.model_names}:
        raise ApiError(400, f"lora_name {body.lora_name!r} is a served model's name", param="lora_name")
    if body.lora_name in {name for name, _ in served.adapters()}:  # of this model or another's
        raise ApiError(400, f"lora_name {body.lora_name!r} is loaded already; unload it first", param="lora_name")
    try:
        await run_in_threadpool(service.runtime.load_lora, body.lora_name, body.lora_path)
    except ModelLoadError as exc:
        raise ApiError(400, served.public_text(str(exc)), param="lora_path") from None
    except InvalidRequestError as exc:  # the name: the Python API's field is lora, this body's lora_name
        param = "lora_name" if exc.param == "lora" else exc.param
        raise ApiError(400, served.public_text(str(exc)), param=param) from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: p.UnloadLoraAdapterRequest, served: Served) -> str:
    """Unload adapter ``lora_name`` once its requests in flight finished; 404 when none has that name."""
    for name, service in served.adapters():
        if name == body.lora_name:
            await run_in_threadpool(service.runtime.unload_lora, name)
            return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
    raise ApiError(404, f"no LoRA adapter is named {body.lora_name!r}", param="lora_name")

