"""LoRA adapters over HTTP, as vLLM serves them: a request's ``model`` names a loaded adapter (or the
base model), ``/v1/models`` lists the adapters after the base model, and ``POST
/v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) / ``POST /v1/unload_lora_adapter``
(``{"lora_name"}``) change them while the server runs: a slot of the model's adapter tables is
written (``aotlm.core.lora_slots``), nothing compiles. A name already loaded is replaced only with
``"load_inplace": true`` (else 400, as vLLM); an adapter a queued or running request uses is not
unloaded or replaced (400). The checks run under the engine's lock with the change, so concurrent
requests see each other's result.
"""

import os

from aotlm.serve.protocol import APIError, bad


class Adapters:
    """The served model's adapters: ``model`` has adapter slots, ``engine`` schedules its requests."""

    def __init__(self, model, engine, base_name: str):
        self.model, self.engine, self.base_name = model, engine, base_name

    def names(self) -> list[str]:
        return list(self.model.adapters)

    def source(self, name: str) -> str:
        """Adapter ``name``'s directory (a card's ``root``, as vLLM's)."""
        return self.model.adapter_source(name) or name

    def resolve(self, model_field: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown model."""
        if model_field is None or model_field == self.base_name:
            return None
        if model_field in self.names():
            return model_field
        raise APIError(
            404,
            f"the model '{model_field}' does not exist; this server serves '{self.base_name}' and the "
            f"LoRA adapters {self.names()}",
            "model",
            code="model_not_found",
        )

    def load(self, body: dict) -> str:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == self.base_name:
            raise bad(f"'{name}' is the base model's name; give the adapter another", "lora_name")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):
            raise bad("'load_inplace' must be true or false", "load_inplace")
        if not os.path.isdir(os.path.expanduser(path)):
            raise bad(f"lora_path {path!r} is not a directory on the server", "lora_path")

        def load():  # checked under the engine's lock: of two loads of one new name, one wins
            if name in self.names() and not inplace:
                raise bad(
                    f"the LoRA adapter '{name}' is already loaded; to replace it, set 'load_inplace' to true",
                    "lora_name",
                )
            return self.model.load_adapter(name, path)

        try:
            self.engine.change_adapter(name, load)
        except ValueError as e:  # a bad adapter, no free slot, in use (InvalidRequest is one)
            raise bad(str(e), getattr(e, "param", None) or "lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> str:
        name = _field(body, "lora_name")

        def unload():  # checked under the engine's lock, as in load
            if name not in self.names():
                raise APIError(
                    404, f"no LoRA adapter named '{name}' is loaded", "lora_name", code="model_not_found"
                )
            return self.model.unload_adapter(name)

        try:
            self.engine.change_adapter(name, unload)
        except ValueError as e:
            raise bad(str(e), "lora_name") from None
        return f"Success: LoRA adapter '{name}' removed successfully."


def _field(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"'{key}' must be a non-empty string", key)
    return value


def add_adapter_routes(app, adapters: Adapters | None, check_key, read_json) -> None:
    """The load / unload routes (``read_json(request)``: the body as a JSON object); without adapter
    slots they answer 400 saying how to get them."""
    from fastapi import Request  # local: optional [serve] extra
    from fastapi.responses import PlainTextResponse  # local: optional [serve] extra
    from starlette.concurrency import run_in_threadpool  # local: optional [serve] extra

    async def change(request: Request, how: str):
        check_key(request)
        if adapters is None:
            raise bad("this server has no LoRA adapter slots; start it with --max-loras N or --lora NAME=DIR")
        body = await read_json(request)
        return PlainTextResponse(await run_in_threadpool(getattr(adapters, how), body))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await change(request, "load")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await change(request, "unload")
