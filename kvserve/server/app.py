"""The OpenAI-compatible HTTP app: `build_app(engine, args) -> FastAPI`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], GET /health,
GET /version, GET /metrics, POST /tokenize, POST /detokenize, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint), the live dashboard (GET /dashboard,
/dashboard/data: kvserve/server/dashboard.py), with --kv-transfer-role POST /v1/kv/prefill
and/or /v1/kv/import (prefill/decode disaggregation: kvserve/server/kv_routes.py), and with
--enable-lora POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request, Response

from kvserve import __version__
from kvserve.config import parse_size
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.server.dashboard import install_dashboard
from kvserve.server.errors import BadRequest, NotFound, Unavailable, install_error_handlers
from kvserve.server.guard import DEFAULT_MAX_BODY_BYTES, GuardMiddleware, early_rejection
from kvserve.server.kv_routes import KVHandover, raw_body_paths
from kvserve.server.lora_routes import install_lora_routes
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
)
from kvserve.server.serving import (
    ServerState,
    admission_error,
    check_request,
    off_loop,
    with_cancellation,
)
from kvserve.server.serving_chat import create_chat_completion, render_chat
from kvserve.server.serving_completions import create_completion


class APIService:
    """What the server's routes share: the engine, the server state and the KV handover (None
    without --kv-transfer-role); `build_app` wires one method per route."""

    def __init__(self, engine: AsyncEngine, state: ServerState, handover: KVHandover | None):
        self.engine = engine
        self.state = state
        self.handover = handover

    async def completions(self, request: CompletionRequest, raw_request: Request):
        if self.handover is not None:
            self.handover.claim_namespace(request, raw_request)
        return await create_completion(request, self.state)

    async def chat_completions(self, request: ChatCompletionRequest, raw_request: Request):
        if self.handover is not None:
            self.handover.claim_namespace(request, raw_request)
        return await create_chat_completion(request, self.state)

    def model_card(self, name: str) -> dict:
        """A served model's card; a LoRA adapter's names its path as `root` and the base model
        as `parent` (as vLLM's)."""
        path = self.state.lora_adapters.get(name)
        return {
            "id": name,
            "object": "model",
            "created": self.state.created,
            "owned_by": "kvserve",
            "root": name if path is None else path,
            "parent": None if path is None else self.state.model_name,
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self):
        names = [*self.state.served_model_names, *self.state.lora_adapters]
        return {"object": "list", "data": [self.model_card(n) for n in names]}

    async def model(self, model_id: str):
        if model_id not in self.state.served_model_names and (
            model_id not in self.state.lora_adapters
        ):
            raise NotFound(
                f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
            )
        return self.model_card(model_id)

    async def health(self):
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            raise Unavailable(str(e)) from None
        if not self.engine.accepting:
            raise Unavailable("shutting down")
        return {"status": "ok", "engine_restarts": self.engine.restarts}

    async def version(self):
        return {"version": __version__}

    async def metrics(self):
        body, content_type = self.engine.metrics.render()
        return Response(body, media_type=content_type)

    async def tokenize(self, request: TokenizeRequest):
        check_request(self.state, request.model)
        request.check()
        engine = self.engine
        tok = engine.tokenizer
        if request.messages is not None:
            ids = await off_loop(
                render_chat,
                tok,
                chat_messages(request.messages),
                request.add_generation_prompt,
                request.tools,
            )
        else:
            ids = await off_loop(
                tok.encode, request.prompt, add_special_tokens=request.add_special_tokens
            )
        # json.dumps in a worker: FastAPI's own encoder walks a 400k-id list in Python on the loop
        body = await off_loop(
            json.dumps, {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        )
        return Response(body, media_type="application/json")

    async def tokenizer_info(self):
        """The tokenizer as tokenizer_config.json describes one (vLLM's /tokenizer_info): what
        a client needs to tokenize through /tokenize and render chats itself."""
        tok = self.engine.tokenizer
        info = {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "model_max_length": self.engine.max_model_len,
        }
        if tok.pad_token is not None:
            info["pad_token"] = tok.pad_token
        if getattr(tok, "chat_template", None):
            info["chat_template"] = tok.chat_template
        return info

    async def detokenize(self, request: DetokenizeRequest):
        check_request(self.state, request.model)
        vocab = self.engine.tokenizer.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {
            "prompt": await off_loop(
                self.engine.tokenizer.decode, request.tokens, skip_special_tokens=False
            )
        }


def _kv_handover(engine: AsyncEngine, args) -> KVHandover | None:
    """The KV handover of --kv-transfer-role (None without one). ValueError: a role this engine
    cannot serve."""
    role = getattr(args, "kv_transfer_role", None)
    if role is None:
        return None
    return KVHandover(
        engine,
        role,
        getattr(args, "kv_transfer_key", None),
        shared_prefix=getattr(args, "kv_transfer_shared_prefix", False),
        max_bytes=getattr(args, "max_kv_transfer_bytes", None),
        body_timeout=getattr(args, "body_timeout", None),
    )


def build_app(engine: AsyncEngine, args=None) -> FastAPI:
    """`args`: the parsed `kvserve serve` flags (served_model_name, api_key, max_body_bytes,
    kv_transfer_*); any of them may be missing. ValueError: a KV transfer role this engine
    cannot serve."""
    api_key = getattr(args, "api_key", None) or None
    max_body = parse_size(getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES)
    state = ServerState(
        engine=engine,
        served_model_names=[getattr(args, "served_model_name", None) or engine.model_name],
        api_key=api_key,
        max_body_bytes=max_body,
    )
    role = getattr(args, "kv_transfer_role", None)
    handover = _kv_handover(engine, args)
    app = FastAPI(
        title="kvserve",
        version=__version__,
        description="OpenAI-compatible API of the kvserve LLM serving engine",
    )
    app.state.kv = state
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body,
        metrics_public=getattr(args, "metrics_public", False),
        body_timeout=getattr(args, "body_timeout", None),
        overloaded=lambda: admission_error(state),
        raw_body_paths=raw_body_paths(role),
    )
    # the same answer, given by the HTTP protocol before any ASGI work (connections.py)
    app.state.early_rejection = early_rejection(
        api_key, lambda pending: admission_error(state, pending)
    )
    api = APIService(engine, state, handover)
    app.post("/v1/completions")(with_cancellation(api.completions))
    app.post("/v1/chat/completions")(with_cancellation(api.chat_completions))
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.get("/health")(api.health)
    app.get("/version")(api.version)
    app.get("/metrics")(api.metrics)
    install_dashboard(
        app,
        engine.metrics,
        state.served_model_names[0],
        speculative=engine.core.config.speculative is not None,
    )
    app.post("/tokenize")(api.tokenize)
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        app.get("/tokenizer_info")(api.tokenizer_info)
    if handover is not None:
        handover.install(app)
    if engine.core.config.enable_lora:
        install_lora_routes(app, state)
    app.post("/detokenize")(api.detokenize)
    return app
