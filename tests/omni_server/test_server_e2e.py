"""End-to-end: one real ``omni-server serve`` process on loopback (CPU), many clients.

Covers generate, n > 1, concurrent clients, invalid inputs (400 naming the field,
404 unknown model/route), one failing request answered 500 while the server lives
on, abort on client disconnect with the KV pool back at baseline, and 200
sequential requests without leaked blocks or growing engine memory.
"""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

FAULT_PROMPT = "a black triangle on a white background"  # valid words; the engine is told to fail it
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "white", "black")
SHAPES = ("circle", "square", "triangle", "diamond")


def prompt(i: int) -> str:
    """A distinct valid prompt per i (the shipped model has a closed vocabulary)."""
    return f"a {COLORS[i % 8]} {SHAPES[i // 8 % 4]} on a {COLORS[(i + 3) % 8]} background"


BLOCK_SIZE = 16
POOL_ROWS = 12  # the module's KV pool holds 12 full-length CFG rows: a guided n=10 request (20 rows) never fits


def _pool_bytes(rows: int) -> int:
    """KV bytes for ``rows`` rows of the served model's longest request, plus the allocator's null block."""
    import omni_models
    from diffusion_kv.sizing import kv_cache_bytes_per_block

    pipeline = omni_models.load(os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny"), device="cpu")
    (job,) = pipeline.prepare(omni_models.resolve_request(pipeline.info, omni_models.GenerationRequest(prompt="a")))
    row_tokens = job.rows[0].target_len + pipeline.info.image.max_prompt_tokens
    blocks_per_row = -(-row_tokens // BLOCK_SIZE)
    return (rows * blocks_per_row + 1) * kv_cache_bytes_per_block(pipeline.kv_cache_specs(), BLOCK_SIZE)


@pytest.fixture(scope="module")
def server(server_factory):
    handle = server_factory(
        "--max-num-seqs",
        "4",
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-cache-memory-bytes",
        str(_pool_bytes(POOL_ROWS)),
        env={"OMNI_SERVER_FAULT_PROMPT": FAULT_PROMPT},
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def card(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    return models["data"][0]


def _post(server, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=timeout)


def _images(response: httpx.Response) -> list[Image.Image]:
    assert response.status_code == 200, response.text
    images = []
    for item in response.json()["data"]:
        image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert image.format == "PNG"
        images.append(image)
    return images


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _kv_in_use(server, tools) -> float:
    return tools.metric(server.metrics(), "omni:kv_cache_blocks_in_use")


def test_health_models_and_metrics(server, card, tools) -> None:
    # While the engine loaded, profiled and warmed up, /health answered 503 "engine_starting".
    assert server.starting_health, "never saw /health before the engine was ready"
    assert all(seen["status"] == 503 and seen["error"]["code"] == "engine_starting" for seen in server.starting_health)
    assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
    assert card["id"] == "omni-shapes-tiny"
    assert card["sizes"] and card["default_size"] in card["sizes"]
    text = server.metrics()
    assert tools.metric(text, "omni:engine_ready") == 1.0
    assert tools.metric(text, "omni:kv_cache_blocks_total") > 0
    assert tools.metric(text, "omni:kv_cache_blocks_in_use") == 0.0
    for name in (
        "omni:num_requests_running",
        "omni:num_requests_waiting",
        "omni:request_queue_time_seconds_bucket",
        "omni:denoise_step_latency_seconds_bucket",
        "omni:e2e_request_latency_seconds_bucket",
    ):
        assert name in text


def test_generate_one_image_of_the_default_size(server, card) -> None:
    (image,) = _images(
        _post(
            server,
            {
                "prompt": "a red circle on a blue background",
                "num_inference_steps": 2,
                "model": card["id"],
                "response_format": "b64_json",
                "seed": 1,
            },
        )
    )
    width, height = (int(part) for part in card["default_size"].split("x"))
    assert image.size == (width, height)
    assert image.mode == "RGB"


def test_same_seed_gives_the_same_image_and_another_seed_does_not(server) -> None:
    body = {"prompt": "a green square", "num_inference_steps": 2, "seed": 7}
    first = _post(server, body).json()["data"][0]["b64_json"]
    again = _post(server, body).json()["data"][0]["b64_json"]
    other = _post(server, {**body, "seed": 8}).json()["data"][0]["b64_json"]
    assert first == again
    assert first != other


def test_n_images_in_one_request(server) -> None:
    images = _images(
        _post(
            server, {"prompt": "a yellow triangle", "n": 3, "num_inference_steps": 1, "seed": 3, "guidance_scale": 1.0}
        )
    )
    assert len(images) == 3
    assert len({image.tobytes() for image in images}) == 3  # one seed per image: seed, seed+1, seed+2


def test_concurrent_clients_are_all_served(server) -> None:
    bodies = [
        {"prompt": prompt(i), "num_inference_steps": 1, "seed": i, "n": 1 + i % 2, "guidance_scale": 1.0}
        for i in range(6)
    ]
    with ThreadPoolExecutor(max_workers=6) as pool:
        responses = list(pool.map(lambda body: _post(server, body), bodies))
    for body, response in zip(bodies, responses, strict=True):
        assert len(_images(response)) == body["n"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 11}, "n"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "4096x4096"}, "size"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "x", "seed": -5}, "seed"),
        ({"prompt": "x", "quality": "hd"}, "quality"),
        ({"prompt": "x", "negative_prompt": ["a"]}, "negative_prompt"),
    ],
)
def test_invalid_fields_get_400_naming_the_field(server, body: dict, param: str) -> None:
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["code"], str)


def test_a_prompt_the_model_rejects_names_the_prompt(server) -> None:
    response = _post(server, {"prompt": "zebra " * 500})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_malformed_json_gets_400(server) -> None:
    response = httpx.post(
        f"{server.url}/v1/images/generations",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_unknown_model_and_route_get_404(server) -> None:
    response = _post(server, {"prompt": "x", "model": "dall-e-3"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "model"
    response = httpx.get(f"{server.url}/v1/nothing-here", timeout=10)
    assert response.status_code == 404
    assert isinstance(response.json()["error"]["message"], str)


def test_a_request_the_pool_can_never_hold_fails_alone(server, tools) -> None:
    # 10 guided images need 20 rows; the pool (POOL_ROWS rows) cannot hold them even when empty.
    with ThreadPoolExecutor(max_workers=2) as pool:
        huge = pool.submit(
            _post, server, {"prompt": "a red circle", "n": 10, "guidance_scale": 4.0, "num_inference_steps": 1}
        )
        small = pool.submit(
            _post, server, {"prompt": "a white circle", "num_inference_steps": 1, "guidance_scale": 1.0}
        )
        huge_response, small_response = huge.result(), small.result()
    assert huge_response.status_code == 400, huge_response.text
    error = huge_response.json()["error"]
    assert error["code"] == "kv_capacity_exceeded"
    assert "cannot fit even when the block pool is empty" in error["message"]
    assert len(_images(small_response)) == 1


def test_an_engine_failure_of_one_request_is_a_500_and_the_server_lives_on(server) -> None:
    response = _post(server, {"prompt": FAULT_PROMPT, "num_inference_steps": 1, "guidance_scale": 1.0})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "engine_error" and "injected engine fault" in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert (
        len(_images(_post(server, {"prompt": "a black square", "num_inference_steps": 1, "guidance_scale": 1.0}))) == 1
    )


def test_client_disconnect_aborts_and_frees_the_blocks(server, tools) -> None:
    baseline = _kv_in_use(server, tools)
    aborted_before = tools.metric(server.metrics(), "omni:request_finished_total", outcome="aborted")
    body = b'{"prompt": "a purple circle", "num_inference_steps": 1000, "n": 2}'
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        _wait_for(lambda: _kv_in_use(server, tools) > baseline, 30, "the request to hold KV blocks")
    started = time.monotonic()
    _wait_for(lambda: _kv_in_use(server, tools) == baseline, 10, "the pool to return to its baseline")
    assert time.monotonic() - started < 10
    text = server.metrics()
    assert tools.metric(text, "omni:num_requests_running") == 0
    assert tools.metric(text, "omni:request_finished_total", outcome="aborted") == aborted_before + 1


def test_requests_wait_for_capacity_instead_of_failing(server) -> None:
    # 7 concurrent requests of 2 images each exceed max_num_seqs=4: the rest queue, then all succeed.
    barrier = threading.Barrier(7)

    def run(i: int) -> httpx.Response:
        barrier.wait(10)
        return _post(server, {"prompt": prompt(i), "n": 2, "num_inference_steps": 1, "guidance_scale": 1.0})

    with ThreadPoolExecutor(max_workers=7) as pool:
        responses = list(pool.map(run, range(7)))
    assert all(len(_images(response)) == 2 for response in responses)


def test_200_sequential_requests_leak_no_blocks_and_no_memory(server, tools) -> None:
    engine = server.engine_pid()
    with server.client() as client:

        def one(i: int) -> None:
            response = client.post(
                "/v1/images/generations",
                json={"prompt": prompt(i), "num_inference_steps": 1, "seed": i, "guidance_scale": 1.0},
            )
            assert response.status_code == 200, response.text

        for i in range(20):  # settle allocator caches before the baseline
            one(i)
        before = {name: tools.rss_bytes(pid) for name, pid in (("engine", engine), ("api", server.process.pid))}
        successes = tools.metric(server.metrics(), "omni:request_finished_total", outcome="success")
        for i in range(200):
            one(i)
        after = {name: tools.rss_bytes(pid) for name, pid in (("engine", engine), ("api", server.process.pid))}
    text = server.metrics()
    assert tools.metric(text, "omni:request_finished_total", outcome="success") == successes + 200
    assert tools.metric(text, "omni:kv_cache_blocks_in_use") == 0
    for name in before:
        growth = after[name] - before[name]
        assert growth < 32 * 2**20, f"{name} process RSS grew by {growth / 2**20:.1f} MiB over 200 requests"


# -- schema fuzzing against the server's own OpenAPI document ---------------------------------------


def _strategy(schema: dict, defs: dict):
    """A hypothesis strategy for the JSON-schema subset pydantic emits for the request; unknown keywords fail."""
    from hypothesis import strategies as st

    if "$ref" in schema:
        return _strategy(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([_strategy(option, defs) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "null":
        return st.none()
    if kind == "object" and "properties" not in schema:
        # A free-form object (the step cache's knobs): short keys, JSON scalar values.
        assert schema.get("additionalProperties", True) is True, schema
        scalars = (
            st.none() | st.booleans() | st.integers(-3, 50) | st.floats(-1, 2, allow_nan=False) | st.text(max_size=8)
        )
        from omni_models.step_cache import KNOBS

        keys = st.sampled_from(["preset", *KNOBS]) | st.text(max_size=8)
        return st.dictionaries(keys, scalars, max_size=3)
    if kind == "object":
        properties = {name: _strategy(sub, defs) for name, sub in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: s for name, s in properties.items() if name in required},
            optional={name: s for name, s in properties.items() if name not in required},
        )
    raise AssertionError(f"the fuzzer does not understand this schema, extend it: {schema}")


def _allowed_types(schema: dict, defs: dict) -> set[str]:
    if "$ref" in schema:
        return _allowed_types(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return set().union(*(_allowed_types(option, defs) for option in schema["anyOf"]))
    if "const" in schema or "enum" in schema:
        return {"string"}
    return {schema["type"]}


def _violations(schema: dict, defs: dict):
    """Values that break ``schema``: a JSON type it does not allow, or a number outside its bounds."""
    from hypothesis import strategies as st

    allowed = _allowed_types(schema, defs)
    by_type = {
        "string": st.text(max_size=10),
        "integer": st.integers(-(10**6), 10**6),
        "number": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not x.is_integer()),
        "null": st.none(),
        "boolean": st.booleans(),
        "array": st.lists(st.integers(), max_size=3),
        "object": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    }
    wrong = [
        strategy
        for kind, strategy in by_type.items()
        if kind not in allowed and not (kind == "integer" and "number" in allowed)
    ]
    # A const or enum field (``Literal[0]``, ``Literal[False]``) accepts exactly those values: never draw one of
    # them (nor what compares equal to one, as False == 0) as a "wrong type".
    accepted = [
        v
        for option in schema.get("anyOf", [schema])
        for v in option.get("enum", [option.get("const")])
        if "enum" in option or "const" in option
    ]
    options = [strategy.filter(lambda x, a=accepted: not any(x == v for v in a)) for strategy in wrong]
    for option in schema.get("anyOf", [schema]):
        if option.get("type") in ("integer", "number"):
            if "maximum" in option:
                options.append(st.integers(int(option["maximum"]) + 1, int(option["maximum"]) + 10**6))
            if "minimum" in option:
                options.append(st.integers(int(option["minimum"]) - 10**6, int(option["minimum"]) - 1))
        if option.get("type") == "string" and "pattern" in option:
            import re

            options.append(st.text(max_size=12).filter(lambda s, p=option["pattern"]: not re.fullmatch(p, s)))
        if "enum" in option or "const" in option:
            values = option.get("enum", [option.get("const")])
            options.append(st.text(max_size=8).filter(lambda s, v=values: s not in v))
    return st.one_of(options)


@pytest.fixture(scope="module")
def request_schema(server):
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    defs = document["components"]["schemas"]
    return defs["ImageGenerationRequest"], defs


def test_schema_valid_bodies_never_get_a_server_error(server, request_schema) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    schema, defs = request_schema
    assert schema.get("additionalProperties") is False

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_strategy(schema, defs), st.integers(0, 63) | st.none())
    def check(body: dict, valid_prompt: int | None) -> None:
        # Keep each request cheap (at most 2 images of one step); often swap in prompts from the closed
        # vocabulary so that bodies get past the model's word check and through the engine.
        body = {**body, "n": min(body.get("n") or 1, 2), "num_inference_steps": 1}
        if valid_prompt is not None:
            body["prompt"] = prompt(valid_prompt)
            body.pop("negative_prompt", None)
        response = _post(server, body)
        if response.status_code == 200:
            assert len(response.json()["data"]) == body["n"]
        else:
            assert response.status_code in (400, 404), response.text
            error = response.json()["error"]
            assert error["param"] in body, error  # the model's own checks name a field the client sent

    check()


def test_schema_violations_get_400_naming_the_field(server, request_schema) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    schema, defs = request_schema
    fields = sorted(schema["properties"])

    @settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(fields).flatmap(
            lambda name: st.tuples(st.just(name), _violations(schema["properties"][name], defs))
        )
    )
    def check(case) -> None:
        name, value = case
        body = {"prompt": "a red circle", "num_inference_steps": 1, name: value}
        response = _post(server, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == name, (body, error)
        assert name in error["message"]

    check()


# -- the playground page in headless Chromium ---------------------------------------------------------


def test_playground_types_a_prompt_and_shows_an_image(server, browser) -> None:
    """Headless Chromium through the system chromedriver; nothing leaves the machine (see the ``browser`` fixture)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.set_page_load_timeout(30)
    driver.get(server.url + "/")
    assert "omni-server" in driver.title
    driver.find_element(By.ID, "prompt").send_keys("a green circle on a white background")
    driver.find_element(By.ID, "steps").send_keys("2")
    driver.find_element(By.ID, "generate").click()
    result = WebDriverWait(driver, 60).until(expected_conditions.visibility_of_element_located((By.ID, "result")))
    assert result.get_attribute("src").startswith("data:image/png;base64,")
    WebDriverWait(driver, 10).until(
        lambda d: d.execute_script(
            "const i = document.getElementById('result'); return i.complete && i.naturalWidth > 0;"
        )
    )
    assert driver.find_element(By.ID, "status").text == "Done (2/2 steps)."
    # Any other host is unresolvable for this browser (the rule is checked, not assumed).
    with pytest.raises(WebDriverException, match="ERR_NAME_NOT_RESOLVED"):
        driver.get("http://example.com/")


# -- last: kill the API process itself --------------------------------------------------------------------


def test_sigkill_of_the_api_process_leaves_no_orphans(server, tools) -> None:
    """The engine (PR_SET_PDEATHSIG, closed pipe) and the resource tracker die with the API process."""
    tree = [server.process.pid, *tools.child_pids(server.process.pid)]
    assert server.engine_pid() in tree
    server.process.kill()
    server.process.wait(10)
    deadline = time.monotonic() + 5
    while any(tools.pid_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if tools.pid_alive(pid)]
