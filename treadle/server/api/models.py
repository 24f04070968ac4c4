"""The models a server answers to: /v1/models (OpenAI's list and card, loaded or not) and vLLM's
LoRA adapter routes (/v1/load_lora_adapter, /v1/unload_lora_adapter)."""

from fastapi import Request
from fastapi.responses import PlainTextResponse

from treadle.server.checked_route import checked_router
from treadle.server.engine_client import EngineDead
from treadle.server.openapi_models import GATE, KEYED, replies
from treadle.server.prepare import model_card
from treadle.server.protocol import LoadLoraRequest, ModelCard, ModelList, RequestError, UnloadLoraRequest

router = checked_router()


def adapter_card(hub, adapter) -> ModelCard:
    return ModelCard(id=adapter.name, root=adapter.path, parent=adapter.base, loaded=adapter.base in hub.loaded)


@router.get("/v1/models")
@replies(ModelList, "openai", 400, KEYED, GATE)  # 400: ?loaded= not a boolean
async def models(request: Request, loaded: bool = False):
    state = request.app.state.treadle
    hub = state.hub
    cards = [model_card(state, spec) for spec in hub.catalog.specs() if not loaded or spec.name in hub.loaded]
    cards += [adapter_card(hub, a) for a in hub.adapters.values() if not loaded or a.base in hub.loaded]
    return ModelList(data=cards).model_dump(exclude_none=True)


@router.get("/v1/models/{model_id:path}")
@replies(ModelCard, "openai", 404, KEYED, GATE)
async def model(model_id: str, request: Request):
    state = request.app.state.treadle
    hub = state.hub
    if model_id in hub.adapters:
        return adapter_card(hub, hub.adapters[model_id]).model_dump(exclude_none=True)
    return model_card(state, hub.resolve_name(model_id)).model_dump(exclude_none=True)


@router.post("/v1/load_lora_adapter")
@replies(None, "openai", 400, 404, 503, KEYED, GATE, media=["text/plain"])
async def load_lora_adapter(body: LoadLoraRequest, request: Request):
    """vLLM's: serve a PEFT LoRA folder as the model `lora_name` (plain-text success, as vLLM's)."""
    try:
        await request.app.state.treadle.hub.load_adapter(body.lora_name, body.lora_path, body.base_model_name)
    except EngineDead as e:
        raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
@replies(None, "openai", 400, 404, 503, KEYED, GATE, media=["text/plain"])
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request):
    try:
        await request.app.state.treadle.hub.unload_adapter(body.lora_name)
    except EngineDead as e:
        raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
