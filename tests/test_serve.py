"""`sdnpu serve`: a converted folder behind an OpenAI-style images API, tried with the real `openai` client and
with raw requests on 127.0.0.1 (each bounded by a timeout)."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sdnpu.runtime import GenerateOptions, Pipeline


class _Server:
    """``build_app`` on uvicorn in a thread, on a free port."""

    def __init__(self, folders: list[Path], **kwargs) -> None:
        import uvicorn

        from sdnpu.runtime.server import build_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = build_app(folders, **kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def server(tiny_conversion) -> Iterator[_Server]:
    s = _Server([tiny_conversion.out], queue=2)
    yield s
    s.stop()


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_the_openai_client_draws_what_generate_draws(server, tiny_conversion):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
    name = tiny_conversion.out.name
    assert [m.id for m in client.models.list().data] == [name]
    result = client.images.generate(model=name, prompt="a photo of a cat", n=2, size="256x256",
                                    response_format="b64_json", extra_body={"steps": 2, "seed": 11})
    assert len(result.data) == 2
    theirs = [_pixels(d.b64_json) for d in result.data]
    ours = Pipeline(tiny_conversion.out).generate(GenerateOptions("a photo of a cat", steps=2, seed=11, num_images=2))
    for a, b in zip(theirs, ours, strict=True):
        np.testing.assert_array_equal(a, b)
    kept = server.app.state.served[name].pipe  # the sessions stay open for the next request
    assert kept.keep and {n for n, _ in kept.parts} >= {"text_encoder", "text_encoder_2", "unet", "vae_decoder"}
    info = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert info["sizes"] == ["256x256"] and info["batches"] == [2]


def test_edits_run_image_to_image_and_inpainting(server, tiny_conversion, tmp_path):
    import openai
    from PIL import Image

    rng = np.random.default_rng(0)
    picture = tmp_path / "in.png"
    Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)).save(picture)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
    with picture.open("rb") as f:
        edited = client.images.edit(model=tiny_conversion.out.name, image=f, prompt="a cat", size="256x256",
                                    response_format="b64_json", extra_body={"steps": 4, "strength": 0.5, "seed": 2})
    ours = Pipeline(tiny_conversion.out)(GenerateOptions("a cat", steps=4, seed=2, image=picture, strength=0.5))
    np.testing.assert_array_equal(_pixels(edited.data[0].b64_json), ours)
    # OpenAI's mask: transparent where to draw; sdnpu's: white where to draw
    alpha = np.full((256, 256), 255, np.uint8)
    alpha[64:192, 64:192] = 0
    rgba = tmp_path / "mask-rgba.png"
    Image.fromarray(np.dstack([np.zeros((256, 256, 3), np.uint8), alpha])).save(rgba)
    white = tmp_path / "mask.png"
    Image.fromarray(255 - alpha).save(white)
    with picture.open("rb") as f, rgba.open("rb") as m:
        inpainted = client.images.edit(model=tiny_conversion.out.name, image=f, mask=m, prompt="a cat",
                                       response_format="b64_json", extra_body={"steps": 2, "seed": 2})
    ours = Pipeline(tiny_conversion.out)(GenerateOptions("a cat", steps=2, seed=2, image=picture, mask=white))
    np.testing.assert_array_equal(_pixels(inpainted.data[0].b64_json), ours)


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"prompt": "a cat", "size": "320x256"}, 400, "--res 320x256"),  # a size the folder lacks: the --add
    ({"prompt": "a cat", "guidance": 0.0, "steps": 1}, 400, "--batch 1 --add"),  # guidance-free on batch 2
    ({"prompt": "a cat", "model": "nope"}, 404, "no model 'nope'"),
    ({"prompt": "a cat", "response_format": "url"}, 400, "b64_json only"),
    ({"prompt": "a cat", "size": "big"}, 400, "WIDTHxHEIGHT"),
    ({"prompt": ""}, 422, "prompt"),
    ({"n": 2}, 422, "prompt"),
    ({"prompt": "a cat", "n": 0}, 422, "n"),
    ({"prompt": "a cat", "steps": "many"}, 422, "steps"),
])
def test_bad_requests_are_answered_and_the_server_keeps_serving(server, body, status, says):
    answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == status, answer.text
    assert says in answer.text
    if "error" in answer.json():  # one line: the problem, then its fix once
        message = answer.json()["error"]["message"]
        assert "\n" not in message and message.count(says) == 1, message
    assert server.healthy()


def test_a_request_names_a_lora_of_the_servers_folder(tiny_conversion, tmp_path):
    """``lora`` from ``--lora-dir``: the image equals `sdnpu generate --lora` with the same seed; the next request
    without it draws the base again; a path, an unknown file, or a LoRA on a server without the folder, a 400."""
    from sdnpu.lora import LoraSpec
    from sdnpu.lora.seeded import write_seeded_lora
    from sdnpu.runtime import RuntimeOptions

    loras = tmp_path / "loras"
    loras.mkdir()
    write_seeded_lora(tiny_conversion.out, loras / "style.safetensors", rank=4, strength=0.5)
    s = _Server([tiny_conversion.out], lora_dir=loras)
    try:
        def ask(**extra):
            return httpx.post(f"{s.url}/v1/images/generations", timeout=300,
                              json={"prompt": "a cat", "steps": 2, "seed": 5, **extra})

        styled = ask(lora=["style.safetensors:0.8"])
        assert styled.status_code == 200, styled.text
        styled_runtime = RuntimeOptions(loras=(LoraSpec(loras / "style.safetensors", 0.8),))
        ours = Pipeline(tiny_conversion.out, runtime=styled_runtime)(GenerateOptions("a cat", steps=2, seed=5))
        np.testing.assert_array_equal(_pixels(styled.json()["data"][0]["b64_json"]), ours)
        plain = ask()
        base = Pipeline(tiny_conversion.out)(GenerateOptions("a cat", steps=2, seed=5))
        np.testing.assert_array_equal(_pixels(plain.json()["data"][0]["b64_json"]), base)
        assert np.abs(ours.astype(int) - base.astype(int)).max() > 0
        for bad, says in ((["../style.safetensors"], "not a path"), (["nope.safetensors"], "no LoRA nope")):
            answer = ask(lora=bad)
            assert answer.status_code == 400 and says in answer.text and "style.safetensors" in answer.text
    finally:
        s.stop()


def test_a_lora_on_a_server_without_a_lora_folder_is_400(server):
    answer = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                        json={"prompt": "a cat", "lora": ["style.safetensors"]})
    assert answer.status_code == 400 and "--lora-dir" in answer.text and server.healthy()


def test_not_json_is_422(server):
    answer = httpx.post(f"{server.url}/v1/images/generations", content=b"{not json",
                        headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == 422 and server.healthy()


def test_a_full_queue_answers_429_and_a_client_that_left_costs_nothing(tiny_conversion, monkeypatch):
    """The worker held on an event: one request runs, ``queue`` (1) waits, the next is refused with 429; a
    waiting request whose client has gone is dropped before it draws."""
    s = _Server([tiny_conversion.out], queue=1)
    slot = s.app.state.served[tiny_conversion.out.name]
    hold = threading.Event()
    original = slot.pipeline

    def held(size, loras=()):
        hold.wait(60)
        return original(size, loras)

    monkeypatch.setattr(slot, "pipeline", held)
    body = {"prompt": "a cat", "steps": 1}
    try:
        answers: dict[str, httpx.Response] = {}

        def ask(key: str, timeout: float) -> None:
            try:
                answers[key] = httpx.post(f"{s.url}/v1/images/generations", json=body, timeout=timeout)
            except httpx.TimeoutException:
                answers[key] = None  # the client gave up and closed its connection

        def until(done) -> None:  # bounded: a failing request must not hang the test
            deadline = time.monotonic() + 30
            while not done():
                assert time.monotonic() < deadline, (slot.waiting, answers)
                time.sleep(0.02)

        first = threading.Thread(target=ask, args=("first", 120))
        first.start()
        until(lambda: slot.waiting >= 1)
        ask("leaves", 1.0)  # waits behind the first, gives up after a second
        assert answers["leaves"] is None
        until(lambda: slot.waiting <= 1)  # the server sees the client go and frees its place in the queue
        second = threading.Thread(target=ask, args=("second", 120))
        second.start()
        until(lambda: slot.waiting >= 2)
        ask("third", 30)
        assert answers["third"].status_code == 429 and "already waiting" in answers["third"].text
        hold.set()
        first.join(120)
        second.join(120)
        assert answers["first"].status_code == 200 and answers["second"].status_code == 200
        assert slot.drawn == 2  # the request whose client left was never drawn
        assert s.healthy()
    finally:
        hold.set()
        s.stop()


def test_sessions_stay_open_where_they_fit(tiny_conversion, monkeypatch):
    """All sessions where all fit; where memory is short, the largest that fit beside the stage of the largest
    one not kept (the rest opened per request); none where nothing fits."""
    from sdnpu import memory
    from sdnpu.runtime.server import sessions_to_keep
    from sdnpu.runtime.session import component_path, weight_bytes

    folder = tiny_conversion.out
    names = ["text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder"]
    assert sessions_to_keep(folder, None, reference=False) == frozenset(names)
    sizes = {c: weight_bytes(component_path(folder, c)) for c in names}
    big = sorted(names, key=lambda c: -sizes[c])
    # room for the largest two and the third's stage, not for the third beside them and the fourth's stage
    budget = 2 * (sizes[big[0]] + sizes[big[1]] + sizes[big[2]])
    assert 2 * (sizes[big[0]] + sizes[big[1]] + sizes[big[2]] + sizes[big[3]]) > budget
    monkeypatch.setattr(memory, "available_bytes", lambda: int(budget / 0.8) + 64)
    kept = sessions_to_keep(folder, None, reference=False)
    assert big[0] in kept and big[1] in kept and big[2] not in kept and len(kept) < len(names)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)  # 1 MB: nothing fits beside the rest
    assert sessions_to_keep(folder, None, reference=False) == frozenset()


def test_a_pipeline_keeps_the_sessions_it_is_told_to(tiny_conversion):
    from sdnpu.runtime.text2image import GenerateOptions, Pipeline

    pipe = Pipeline(tiny_conversion.out, keep_sessions=frozenset({"unet"}))
    pipe(GenerateOptions(prompt="a cat", steps=1, seed=1))
    assert {name for name, _ in pipe.parts} == {"unet"}


def test_serve_refuses_what_is_not_a_converted_folder(tmp_path, capsys):
    from sdnpu.cli import main

    assert main(["serve", str(tmp_path)]) == 2
    assert "not a converted pipeline folder" in capsys.readouterr().err
