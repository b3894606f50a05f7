"""schemathesis against the server's own /openapi.json: schema-valid bodies are answered (and answers match
the response schemas), schema-invalid ones are refused with a documented 4xx, nothing is a 5xx.

On the Cloudflare route the body's model must also equal the model in the path, a cross-field rule JSON
Schema cannot state, so that one operation runs without the "valid data is accepted" check.

Images (issue 21): the schema describes `images` as the server reads them (clefcore/images.py's limits), its
example request carries one and is answered, and schemathesis draws real images for the schema's custom
image formats (tests/schemathesis_images.py), so "valid data is accepted" holds for them too."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clefcore import images
from clefcore.engine import NO_IMAGES
from clefcore.server import openapi

from server_harness import Server, check_client_rules

HOOKS = Path(__file__).parent / "schemathesis_images.py"


@pytest.fixture(scope="module")
def server():
    with Server().wait_ready() as s:
        yield s


def schemathesis(server: Server, *options: str) -> None:
    pytest.importorskip("schemathesis")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base}/openapi.json",
           "--max-examples", "150", "--seed", "1729", "--max-failures", "5", *options]
    env = dict(os.environ, SCHEMATHESIS_HOOKS=str(HOOKS))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert server.proc.poll() is None


@pytest.mark.slow
def test_schemathesis_bare_routes(server):
    schemathesis(server, "--checks", "all", "--exclude-path-regex", "cloudflare")


@pytest.mark.slow
def test_schemathesis_cloudflare_route(server):
    schemathesis(server, "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                 "--include-path-regex", "cloudflare")


# --- images in the schema --------------------------------------------------------------------------------

def _spec(server: Server) -> dict:
    r = server.get("/openapi.json")
    assert r.status == 200, r
    return r.json()


def _validator(spec: dict, name: str):
    """A JSON Schema 2020-12 validator for one component (OpenAPI 3.1 schemas are 2020-12), refs resolved."""
    jsonschema = pytest.importorskip("jsonschema")
    text = json.dumps(spec["components"]["schemas"]).replace("#/components/schemas/", "#/$defs/")
    defs = json.loads(text)
    schema = dict(defs[name], **{"$defs": defs})
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_describes_images(server):
    spec = _spec(server)
    assert spec["openapi"].startswith("3.")
    for name in ("SystemOneRequest", "CloudflareRequest"):
        field = spec["components"]["schemas"][name]["properties"]["images"]
        assert field["type"] == "array" and field["maxItems"] == images.MAX_IMAGES == 4
        for limit in ("4 MiB", "16 megapixels", "8 MiB decoded in total", "--max-body-bytes", "422"):
            assert limit in field["description"], limit
        data_url, obj = field["items"]["oneOf"]
        assert data_url["type"] == "string" and data_url["pattern"].startswith("^[Dd][Aa][Tt][Aa]:")
        assert obj["type"] == "object" and obj["required"] == ["content_type", "base64"]
        assert obj["additionalProperties"] is False
        assert obj["properties"]["content_type"]["enum"] == list(images.CONTENT_TYPES)
        assert obj["properties"]["base64"]["type"] == "string"
        validator = _validator(spec, name)
        example = spec["components"]["schemas"]["SystemOneRequest"]["examples"][0]
        png = example["images"][0].split(",", 1)[1]
        good = [f"data:image/{t};base64,{png}" for t in ("png", "jpeg", "jpg", "webp")]
        assert validator.is_valid(dict(example, images=good))
        assert validator.is_valid(dict(example, images=["DATA:IMAGE/PNG;base64," + png]))
        assert validator.is_valid(dict(example, images=[{"content_type": "image/webp", "base64": png}]))
        assert validator.is_valid(dict(example, images=[]))
        for bad in (good + good[:1],                                          # a 5th image
                    ["https://example.com/cat.png"], ["/etc/passwd"], [png],  # URL, path, raw base64
                    ["data:image/gif;base64," + png], ["data:image/png;base64," + png[:-1]],
                    [{"content_type": "image/png"}], [{"content_type": "image/bmp", "base64": png}],
                    [{"content_type": "image/png", "base64": png, "url": "x"}],
                    "data:image/png;base64," + png):                             # not an array
            assert not validator.is_valid(dict(example, images=bad)), bad
    text = spec["paths"]["/v1/systemone"]["post"]["responses"]["422"]["description"]
    assert "images[i]" in text and "image payload is invalid" in text and NO_IMAGES in text
    cf = spec["paths"]["/client/v4/accounts/{account}/ai/run/@cf/cloudflare/{model}"]["post"]
    assert NO_IMAGES in cf["responses"]["422"]["description"]


def test_schema_example_with_an_image_is_answered(server):
    """The example request (one PNG) validates against the schema and is answered, on both routes, with more
    input tokens than the same request without the image; the object form is answered the same."""
    spec = _spec(server)
    example = spec["components"]["schemas"]["SystemOneRequest"]["examples"][0]
    assert len(example["images"]) == 1
    assert _validator(spec, "SystemOneRequest").is_valid(example)
    r = server.decide(example)
    assert r.status == 200, r
    check_client_rules(example, r.json())
    text_only = copy.deepcopy(example)
    del text_only["images"]
    t = server.decide(text_only)
    assert t.status == 200, t
    assert r.json()["usage"]["input_tokens"] > t.json()["usage"]["input_tokens"]
    png = example["images"][0].split(",", 1)[1]
    as_object = dict(example, images=[{"content_type": "image/png", "base64": png}])
    o = server.decide(as_object)
    assert o.status == 200 and o.json() == r.json(), o

    assert _validator(spec, "CloudflareRequest").is_valid(example)
    cf = server.post("/client/v4/accounts/test/ai/run/@cf/cloudflare/clef-flash", example)
    assert cf.status == 200, cf
    envelope = cf.json()
    assert envelope["success"] is True
    assert envelope["result"]["usage"] == r.json()["usage"]


def test_no_images_deployment_schema_and_refusal():
    with Server("--no-images").wait_ready() as s:
        spec = _spec(s)
        field = spec["components"]["schemas"]["SystemOneRequest"]["properties"]["images"]
        assert field["maxItems"] == 0 and "--no-images" in field["description"]
        example = spec["components"]["schemas"]["SystemOneRequest"]["examples"][0]
        assert "images" not in example and _validator(spec, "SystemOneRequest").is_valid(example)
        assert s.decide(example).status == 200
        assert s.decide(dict(example, images=[])).status == 200
        png = openapi.EXAMPLE_PNG
        for item in ("data:image/png;base64," + png, {"content_type": "image/png", "base64": png}):
            r = s.decide(dict(example, images=[item]))
            assert r.status == 422, r
            assert r.json()["error"]["message"] == NO_IMAGES and r.json()["error"]["field"] == "images"
