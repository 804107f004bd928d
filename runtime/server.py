"""``sdnpu serve``: converted folders behind an OpenAI-style images API (FastAPI on uvicorn).

    POST /v1/images/generations   JSON: model, prompt, n, size "WxH", response_format "b64_json", and sdnpu's
                                  extras: steps, guidance, seed, negative_prompt, scheduler, lora
    POST /v1/images/edits         multipart: image, mask (optional), prompt, model, n, size, response_format,
                                  strength, steps, guidance, seed, negative_prompt, scheduler, lora
    GET  /v1/models               the folders served: their sizes and denoiser batches
    GET  /health

Each folder is a model named by its directory. Its sessions stay open between requests where they fit
(``sessions_to_keep``: the largest that fit beside the others' stages; the rest opened per request;
one pipeline per size and LoRAs, the last asked for), and its requests run one at a time on a worker thread of
its own, in arrival order; at most ``queue`` wait behind the running one, and a request beyond them is
answered 429. A request whose client has gone before it starts is dropped, and one whose client goes while it
draws stops at the next step. What the folder cannot draw (a size or batch it lacks, a mask without an
inpainting-capable folder) is a 400 whose message names the ``sdnpu convert ... --add`` that fixes it; a
malformed request is a 422. A mask is white where to draw; one with an alpha channel follows OpenAI's rule
instead (transparent where to draw). ``lora``: ``["NAME[:SCALE]", ...]``, files of the server's ``lora_dir``
(``--lora-dir``; none without it), applied as the sessions open, stacked in order (``sdnpu generate --lora``).
"""

# no ``from __future__ import annotations``: FastAPI reads the endpoints' annotations as objects, and the
# request models live in ``build_app``
import asyncio
import base64
import contextlib
import dataclasses
import io
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, Field

from sdnpu import memory
from sdnpu.components import COMPONENTS, module_of
from sdnpu.errors import SdnpuError
from sdnpu.formats import generation
from sdnpu.formats.sizes import sizes_of
from sdnpu.imagesize import Size
from sdnpu.lora import LoraSpec
from sdnpu.runtime.session import RuntimeOptions, component_path, weight_bytes
from sdnpu.runtime.text2image import GenerateOptions, Pipeline

log = logging.getLogger(__name__)

MAX_IMAGES = 8  # per request


class Cancelled(Exception):
    """The client went away: the request's work stops."""


class QueueFull(Exception):
    pass


@dataclass
class Served:
    """One converted folder: its pipeline (sessions kept), its worker and its queue."""

    name: str
    folder: Path
    make: Callable[[Path, Size | None, tuple[Any, ...]], Any]  # (folder, size, LoRAs) -> pipeline, sessions kept
    queue: int
    pipe: Any = None
    loras: tuple[Any, ...] = ()  # the open pipeline's
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))
    waiting: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    drawn: int = 0  # requests drawn to the end (the tests read it)

    def pipeline(self, size: Size | None, loras: tuple[Any, ...] = ()) -> Any:
        """The pipeline at ``size`` (None: the folder's first) with ``loras``, reusing the open one where it
        is that."""
        if self.pipe is None or self.loras != loras or (size is not None and Size(*self.pipe.image_size) != size):
            self.pipe = None  # the old sessions go before the new ones open
            self.pipe, self.loras = self.make(self.folder, size, loras), loras
        return self.pipe

    def info(self) -> dict[str, Any]:
        denoiser = "transformer" if (self.folder / "transformer").is_dir() else (
            "unet" if (self.folder / "unet").is_dir() else "unet_controlnet")
        files = sizes_of(self.folder / denoiser)
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "sdnpu", "path": str(self.folder),
                "sizes": list(dict.fromkeys(f"{f.size.width}x{f.size.height}" for f in files)),
                "batches": list(dict.fromkeys(f.batch for f in files if f.batch is not None))}

    async def run(self, job: Callable[[Callable[[], bool]], Any], gone: Callable[[], Any]) -> Any:
        """``job`` (given a function that says whether the client is gone) on the worker, after the requests
        before it; refused (``QueueFull``) where ``queue`` already wait."""
        with self.lock:
            if self.waiting > self.queue:  # the running one and ``queue`` waiting
                raise QueueFull
            self.waiting += 1
        left = threading.Event()

        def work() -> Any:
            if left.is_set():
                raise Cancelled
            return job(left.is_set)

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.worker, work)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # a dropped job's end is nobody's
        watch = asyncio.create_task(_watch(gone, left))
        try:
            done, _ = await asyncio.wait({future, watch}, return_when=asyncio.FIRST_COMPLETED)
            if future in done:
                return future.result()
            raise Cancelled  # the client left: not started, the worker skips it; started, it stops at a step
        finally:
            watch.cancel()
            with self.lock:
                self.waiting -= 1


async def _watch(gone: Callable[[], Any], left: threading.Event) -> None:
    """Set ``left`` once the client has disconnected (``gone``: the request's ``is_disconnected``)."""
    while not left.is_set():
        if await gone():
            left.set()
            return
        await asyncio.sleep(0.2)


def parse_size(text: str | None) -> Size | None:
    """OpenAI's ``"WxH"`` (width first, as sdnpu's --res), or None for the folder's own."""
    if text in (None, "", "auto"):
        return None
    try:
        width, height = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise SdnpuError(f"size {text!r} is not WIDTHxHEIGHT",
                         hint='ask for "256x256" or another converted size') from None
    return Size(height, width)


def _said(e: SdnpuError) -> str:
    """An error's message and its fix, on one line (a JSON error's ``message``)."""
    return f"{e.message} ({e.hint})" if e.hint else e.message


def _png(image: Any) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _mask_file(data: bytes, folder: Path) -> Path:
    """The uploaded mask as sdnpu takes it (white where to draw): an alpha channel is OpenAI's mask,
    transparent where to draw."""
    try:
        mask = Image.open(io.BytesIO(data))
        mask.load()
    except (OSError, UnidentifiedImageError) as e:
        raise SdnpuError(f"the mask is not an image: {e}", hint="send a PNG") from e
    if mask.mode in ("RGBA", "LA") or (mask.mode == "P" and "transparency" in mask.info):
        alpha = mask.convert("RGBA").getchannel("A")
        mask = alpha.point(lambda a: 255 if a == 0 else 0)
    path = folder / "mask.png"
    mask.convert("L").save(path)
    return path


def sessions_to_keep(folder: Path, size: Size | None, reference: bool) -> frozenset[str]:
    """The components of ``folder`` whose sessions stay open between requests: the largest first, each while
    twice the weight bytes of those kept (the weights, and the activations beside them) plus twice those of
    the largest component not kept (opened for its stage of a request, then dropped, as ``generate`` does)
    stay within 80% of the memory available. Every one where all fit (the tiny folders); none where not
    even the largest fits beside the others' stages."""
    # every component a pipeline folder holds (a ControlNet has a folder of its own), in the table's order
    names = [c for c in COMPONENTS if module_of(c) != "controlnet" and (folder / c).is_dir()]
    try:
        sizes = {c: weight_bytes(component_path(folder, c, reference, size)) for c in names}
    except (SdnpuError, OSError):
        return frozenset()  # what is missing is refused where it is opened, with its fix
    available = memory.available_bytes()
    if available is None:
        return frozenset(names)
    kept: list[str] = []
    for c in sorted(names, key=lambda n: -sizes[n]):
        rest = [sizes[n] for n in names if n not in kept and n != c]
        if 2 * (sum(sizes[n] for n in kept) + sizes[c] + max(rest, default=0)) <= 0.8 * available:
            kept.append(c)
    opened = [c for c in names if c not in kept]
    log.info("%s: sessions kept open between requests: %s; opened per request, stage by stage: %s", folder.name,
             ", ".join(c for c in names if c in kept) or "none", ", ".join(opened) or "none")
    return frozenset(kept)


def lora_specs(items: list[str] | None, lora_dir: Path | None) -> tuple[Any, ...]:
    """A request's ``lora`` entries (``NAME[:SCALE]``) as LoraSpecs of files in ``lora_dir``."""
    if not items:
        return ()
    if lora_dir is None:
        raise SdnpuError("this server takes no LoRAs per request",
                         hint="start it with --lora-dir DIR (the LoRA files requests may name)")
    specs = []
    for item in items:
        spec = LoraSpec.parse(item)
        name = spec.path.name
        if str(spec.path) != name or name in ("", ".", ".."):
            raise SdnpuError(f"LoRA {item!r}: name a file of the server's LoRA folder, not a path",
                             hint=f"one of: {', '.join(sorted(p.name for p in lora_dir.glob('*.safetensors')))}")
        if not (lora_dir / name).is_file():
            raise SdnpuError(f"no LoRA {name} in {lora_dir}",
                             hint=f"one of: {', '.join(sorted(p.name for p in lora_dir.glob('*.safetensors')))}")
        specs.append(LoraSpec(lora_dir / name, spec.scale))
    return tuple(specs)


def build_app(folders: list[Path], *, queue: int = 8, reference: bool = False, runtime: Any = None,
              lora_dir: Path | None = None) -> Any:
    """The ASGI app serving ``folders`` (each a converted folder; its name is the model's id); ``lora_dir``:
    the LoRA files requests may name."""
    base = runtime or RuntimeOptions()

    def make(folder: Path, size: Size | None, loras: tuple[Any, ...]) -> Any:
        return Pipeline(folder, reference=reference, keep_sessions=sessions_to_keep(folder, size, reference), size=size,
                        runtime=dataclasses.replace(base, loras=loras) if loras else base)

    served: dict[str, Served] = {}
    for folder in folders:
        folder = Path(folder)
        if folder.name in served:
            raise SdnpuError(f"two folders named {folder.name}: {served[folder.name].folder} and {folder}",
                             hint="serve folders with different names (the name is the model's id)")
        make(folder, None, ())  # a folder that is not a converted pipeline fails now, not at the first request
        served[folder.name] = Served(folder.name, folder, make, queue)

    app = FastAPI(title="sdnpu", description="converted folders behind an OpenAI-style images API")
    app.state.served = served

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    def pick(model: str | None) -> Served:
        if model is None and len(served) == 1:
            return next(iter(served.values()))
        if model not in served:
            raise LookupError(f"no model {model!r} here; served: {', '.join(served)}")
        return served[model]  # type: ignore[index]

    async def draw(request: Request, model: str | None, opts: dict[str, Any], size: str | None,
                   response_format: str | None, lora: list[str] | None) -> JSONResponse:
        if response_format not in (None, "b64_json"):
            return error(400, f"response_format {response_format!r}: this server answers b64_json only")
        try:
            slot = pick(model)
            wanted = parse_size(size)
            loras = lora_specs(lora, lora_dir)
        except LookupError as e:
            return error(404, str(e), "not_found_error")
        except SdnpuError as e:
            return error(400, _said(e))
        started = time.perf_counter()

        def job(gone: Callable[[], bool]) -> list[Any]:
            pipe = slot.pipeline(wanted, loras)
            n = opts.get("num_images", 1)

            def progress(i: int, steps: int) -> None:
                log.info("[%s] step %d/%d", slot.name, i, steps)
                if gone():
                    raise Cancelled

            images = pipe.generate(GenerateOptions(**opts), progress=progress)
            slot.drawn += 1
            log.info("[%s] %d image%s in %.1f s", slot.name, n, "s" if n > 1 else "", time.perf_counter() - started)
            return images

        try:
            images = await slot.run(job, request.is_disconnected)
        except QueueFull:
            return error(429, f"{slot.name}: {slot.queue} requests are already waiting; try again later",
                         "rate_limit_error")
        except Cancelled:
            log.info("[%s] the client left: request dropped", slot.name)
            return error(499, "the client closed the request")
        except SdnpuError as e:
            return error(400, _said(e))
        return JSONResponse({"created": int(time.time()), "data": [{"b64_json": _png(i)} for i in images]})

    class Generation(BaseModel):
        prompt: str = Field(min_length=1)
        model: str | None = None
        n: int = Field(1, ge=1, le=MAX_IMAGES)
        size: str | None = None
        response_format: str | None = None
        negative_prompt: str = ""
        steps: int | None = Field(None, ge=1, le=1000)
        guidance: float | None = Field(None, ge=0)
        seed: int = 0
        scheduler: str | None = None
        lora: list[str] | None = None

    def defaults(slot_name: str | None, steps: int | None, guidance: float | None) -> tuple[int, float]:
        """The folder's steps and guidance (its ``generation.json``: a Turbo folder's 1 step at 0) where the
        request gives none, as ``sdnpu generate``."""
        gen = generation.Generation()
        with contextlib.suppress(LookupError):
            gen = generation.read(pick(slot_name).folder)
        return (steps if steps is not None else gen.steps, guidance if guidance is not None else gen.guidance)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": list(served)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [s.info() for s in served.values()]}

    @app.post("/v1/images/generations")
    async def generations(body: Generation, request: Request) -> JSONResponse:
        steps, guidance = defaults(body.model, body.steps, body.guidance)
        opts = {"prompt": body.prompt, "negative_prompt": body.negative_prompt, "steps": steps, "guidance": guidance,
                "seed": body.seed, "scheduler": body.scheduler, "num_images": body.n}
        return await draw(request, body.model, opts, body.size, body.response_format, body.lora)

    @app.post("/v1/images/edits")
    async def edits(request: Request, image: UploadFile = File(...), prompt: str = Form(..., min_length=1),
                    mask: UploadFile | None = File(None), model: str | None = Form(None),
                    n: int = Form(1, ge=1, le=MAX_IMAGES), size: str | None = Form(None),
                    response_format: str | None = Form(None), strength: float | None = Form(None, gt=0, le=1),
                    negative_prompt: str = Form(""), steps: int | None = Form(None, ge=1, le=1000),
                    guidance: float | None = Form(None, ge=0), seed: int = Form(0),
                    scheduler: str | None = Form(None), lora: list[str] | None = Form(None)) -> JSONResponse:
        steps, guidance = defaults(model, steps, guidance)
        with tempfile.TemporaryDirectory(prefix="sdnpu-edit-") as tmp:
            picture = Path(tmp) / "image.png"
            picture.write_bytes(await image.read())
            try:
                mask_path = _mask_file(await mask.read(), Path(tmp)) if mask is not None else None
            except SdnpuError as e:
                return error(400, _said(e))
            opts = {"prompt": prompt, "negative_prompt": negative_prompt, "steps": steps, "guidance": guidance,
                    "seed": seed, "scheduler": scheduler, "num_images": n, "image": picture, "strength": strength,
                    "mask": mask_path}
            return await draw(request, model, opts, size, response_format, lora)

    return app


def serve(folders: list[Path], host: str = "127.0.0.1", port: int = 8080, **kwargs: Any) -> None:
    """Serve ``folders`` until interrupted."""
    app = build_app(folders, **kwargs)
    log.info("serving %s on http://%s:%d/v1", ", ".join(app.state.served), host, port)
    uvicorn.run(app, host=host, port=port, log_level="info")
