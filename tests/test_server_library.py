"""The server's parts as a library for asyncio programs (issue 29, item 7), on the CPU with the tiny golden model:

- ``await service.decide(body)`` from concurrent callers: their requests are packed into shared forwards (the
  metrics' record of batch sizes says so) and each gets the answer the engine gives it alone;
- clefcore's routes mounted under a prefix in an aiohttp application of the test's own, beside a route of its
  own, answering a decision, /health, the Cloudflare route, the API key and an unknown path in clefcore's shapes;
- /openapi.json's paths are the route table, and the table is what the application serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from clefcore import cli  # noqa: E402
from clefcore.errors import RequestError  # noqa: E402
from clefcore.server import routes  # noqa: E402
from clefcore.server.admission import Budgets, Refusal, Snapshot  # noqa: E402
from clefcore.server.openapi import build_spec  # noqa: E402
from clefcore.server.service import InferenceFailed, Service, ServiceConfig, Unavailable  # noqa: E402

from server_harness import MODEL, SUPPORT_TICKET, check_client_rules, same_answers, ticket  # noqa: E402

KEY = "library-test-key"


def _states(n: int) -> list[dict]:
    return [ticket(f"Ticket {i}: checkout fails with error E{i * 7} since {i} hours ago; " + "more detail. " * i)
            for i in range(n)]


def test_concurrent_decides_are_packed_into_shared_forwards(monkeypatch, engine):
    # Each forward sleeps 0.3 s (the device process's test hook): the calls that arrive meanwhile queue up and
    # must leave in one packed forward, not one forward each.
    monkeypatch.setenv("CLEFCORE_TEST_BATCH_DELAY_S", "0.3")
    bodies = _states(8)

    async def main():
        service = Service(ServiceConfig(model=str(MODEL)))
        try:
            with pytest.raises(Unavailable) as early:        # not started: refused, nothing queued
                await service.decide(bodies[0])
            assert early.value.reason == "loading the model" and early.value.retry_after_s == 5
            await service.start()
            answers = await asyncio.gather(*(service.decide(body) for body in bodies))
            with pytest.raises(RequestError) as bad:
                await service.decide({"model": "clef", "state": "x", "questions": {}})
            assert bad.value.field == "questions"
            registry = service.metrics.registry
            batches = registry.get_sample_value("clef_batch_size_requests_count")
            requests = registry.get_sample_value("clef_batch_size_requests_sum")
            alone = registry.get_sample_value("clef_batch_size_requests_bucket", {"le": "1.0"})
            assert await service.drain(5.0)
            with pytest.raises(Unavailable):
                await service.decide(bodies[0])
            return answers, batches, requests, alone
        finally:
            await service.stop()

    answers, batches, requests, alone = asyncio.run(main())
    assert requests == len(bodies)                 # every call went through the batcher's forwards
    assert batches < len(bodies) and alone < batches, (batches, alone)   # at least one forward held several
    for body, answer in zip(bodies, answers):
        check_client_rules(body, answer)
        assert same_answers(answer, engine.decide(body)), (answer, engine.decide(body))


def test_an_embedded_service_reports_a_faulted_device_and_refuses_until_it_is_given_up(monkeypatch):
    """The sticky test fault (every call of the device process fails from the request that carries XID on, as after
    an illegal memory access): the request that struck it fails, the one queued behind it and every later call are
    refused with Unavailable, health() says faulted; past the grace the service has failed and asks to be
    stopped, as `clefcore serve` then does."""
    monkeypatch.setenv("CLEFCORE_TEST_STICKY_MARKER", "XID")
    monkeypatch.setenv("CLEFCORE_TEST_BATCH_DELAY_S", "0.3")

    async def main():
        service = Service(ServiceConfig(model=str(MODEL), max_batch_requests=1, min_queue_wait=1000,
                                        device_grace=2.0))
        try:
            await service.start()
            before = service.health()
            # one on the device; the poisoned request (shorter) goes next, the other one waits behind it
            occupied = asyncio.ensure_future(service.decide(ticket("The device is busy with this one.")))
            while not service.metrics.registry.get_sample_value("clef_requests_running"):
                await asyncio.sleep(0.01)
            struck, behind = await asyncio.gather(
                service.decide(ticket("XID 13")),
                service.decide(ticket("A longer state that waits behind the poisoned one, in vain.")),
                return_exceptions=True)
            await occupied
            faulted = service.health()
            with pytest.raises(Unavailable) as later:
                await service.decide(SUPPORT_TICKET)
            await asyncio.wait_for(service.lifecycle.stop_requested.wait(), 2.0 + 10)
            failed = service.health()
            await service.drain(5.0)
            return before, struck, behind, faulted, later.value, failed
        finally:
            await service.stop()

    before, struck, behind, faulted, later, failed = asyncio.run(main())
    assert (before.ready, before.live, before.status) == (True, True, "ok")
    assert isinstance(struck, InferenceFailed) and "sticky" in str(struck)
    assert isinstance(behind, Unavailable) and behind.retry_after_s == 5, behind
    assert (faulted.ready, faulted.live, faulted.status) == (False, True, "faulted")
    assert later.reason == faulted.reason and later.reason.startswith("faulted: device 0 failed its self-check")
    assert (failed.ready, failed.live, failed.status) == (False, False, "failed")
    assert "given up after 2 s faulted" in failed.reason


@contextlib.asynccontextmanager
async def _served(service: Service, app: web.Application | None = None):
    """``service``'s routes under /clef/ (API key KEY) in ``app``, served on loopback: the base URL. Stops both."""
    app = web.Application() if app is None else app
    routes.mount(app, "/clef/", service, api_key=KEY)
    runner = web.AppRunner(app, handler_cancellation=True, auto_decompress=False)
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001 - the port picked for 0
    finally:
        await runner.cleanup()
        await service.stop()


def test_routes_mounted_under_a_prefix_in_an_application_of_our_own(engine):
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    async def main():
        service = Service(ServiceConfig(model=str(MODEL)))
        app = web.Application()
        app.router.add_get("/hello", hello)
        auth = {"Authorization": f"Bearer {KEY}"}
        async with _served(service, app) as base:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/clef/health") as r:      # before start: loading
                    loading = r.status, r.headers.get("Retry-After"), (await r.json())["status"]
                assert loading == (503, "5", "loading")
                await service.start()
                async with http.get(f"{base}/clef/health") as r:
                    health = await r.json()
                    assert r.status == 200 and health["status"] == "ok" and health["device"] == "cpu", health
                async with http.post(f"{base}/clef/v1/systemone", json=SUPPORT_TICKET, headers=auth) as r:
                    decision = await r.json()
                    assert r.status == 200 and r.headers.get("x-request-id"), decision
                check_client_rules(SUPPORT_TICKET, decision)
                assert same_answers(decision, engine.decide(SUPPORT_TICKET))
                async with http.post(f"{base}/clef/v1/systemone", json=SUPPORT_TICKET) as r:   # protected too
                    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                async with http.post(f"{base}/clef/client/v4/accounts/a/ai/run/@cf%2Fcloudflare%2Fclef-flash",
                                     json={"state": SUPPORT_TICKET["state"], "questions": SUPPORT_TICKET["questions"]},
                                     headers=auth) as r:
                    envelope = await r.json()
                    assert r.status == 200 and envelope["success"] and r.headers.get("cf-ai-req-id"), envelope
                assert envelope["result"]["model"] == "clef-flash"
                assert same_answers(envelope["result"], dict(decision, model="clef-flash"))
                async with http.get(f"{base}/clef/v2/nothing") as r:     # clefcore's shape below its prefix
                    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
                async with http.get(f"{base}/clef/openapi.json") as r:
                    spec = await r.json()
                    assert r.status == 200 and spec["servers"] == [{"url": "/clef"}], spec
                assert "/v1/systemone" in spec["paths"]
                async with http.get(f"{base}/clef/metrics") as r:
                    assert r.status == 200 and 'route="/clef/v1/systemone",status="200"' in await r.text()
                async with http.get(f"{base}/hello") as r:      # the application's own route, untouched
                    hello_reply = r.status, await r.json(), r.headers.get("x-request-id")
                assert hello_reply == (200, {"hello": "world"}, None)
            await service.drain(5.0)

    asyncio.run(main())


class RefuseAll:
    """An admission policy of a library caller's own: refuses every prepared request, and records what it read."""

    def __init__(self, budgets: Budgets):
        self.budgets = budgets
        self.asked: list[tuple[int, Snapshot]] = []
        self.unread_asked = 0

    def decide(self, tokens, view, held=0.0):
        self.asked.append((tokens, view))
        return Refusal("queued_work", 7, 12.5, 0.5)

    def unread(self, estimates, view, held):
        self.unread_asked += 1
        return None

    def late(self, view):
        return []


def test_an_admission_policy_of_our_own_is_the_one_asked(engine):
    policies: list[RefuseAll] = []

    def policy(budgets: Budgets) -> RefuseAll:
        policies.append(RefuseAll(budgets))
        return policies[-1]

    async def main():
        service = Service(ServiceConfig(model=str(MODEL), admission=policy, min_queue_wait=2.0, max_queue_wait=9.0))
        async with _served(service) as base:
            await service.start()
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/clef/v1/systemone", json=SUPPORT_TICKET,
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                    answer = r.status, r.headers.get("Retry-After"), await r.json()
            await service.drain(5.0)
        return answer

    with pytest.raises(ValueError, match="admission must be a callable .* got 'cost'"):
        ServiceConfig(model=str(MODEL), admission="cost")
    status, retry_after, body = asyncio.run(main())
    assert status == 429 and retry_after == "7", body
    assert body["error"]["reason"] == "queued_work" and body["error"]["expected_wait_s"] == 12.5
    assert "12.50 s, over the 0.5 s wait budget" in body["error"]["message"]
    (made,) = policies
    assert made.budgets == Budgets(2.0, 9.0, 24576)          # built from the config's budgets
    assert made.unread_asked == 1                             # asked before the body was read, then once prepared
    ((tokens, view),) = made.asked
    assert tokens > 0 and len(view.lanes) == 1 and not view.full


def test_mount_needs_a_prefix():
    with pytest.raises(ValueError, match="prefix"):
        routes.mount(web.Application(), "/", service=None)


def test_openapi_paths_are_the_route_table():
    spec = build_spec(ServiceConfig(model=str(MODEL)), None, routes.openapi_paths())
    documented = {(path, method.upper(), operation["operationId"])
                  for path, methods in spec["paths"].items() for method, operation in methods.items()}
    table = {(route.spec_path or route.path, route.method, route.operation) for route in routes.ROUTES}
    assert documented == table and len(table) == len(routes.ROUTES)

    # and the table is what an application built from it serves (HEAD comes with each GET)
    async def served():
        app = routes.build_app(service=None)
        return {(route.method, route.resource.canonical) for route in app.router.routes() if route.method != "HEAD"}

    expected = {(route.method, route.path.replace("{model:.+}", "{model}")) for route in routes.ROUTES}
    assert asyncio.run(served()) == expected and len(expected) == len(routes.ROUTES)


def test_the_service_needs_no_aiohttp():
    """An asyncio program that only calls Service.decide does not load the HTTP side."""
    done = subprocess.run([sys.executable, "-c", "import sys; import clefcore.server.service; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_service_config_is_the_serve_flags():
    """The config an embedding program builds from keywords is the one `clefcore serve` builds from its flags,
    defaults included; a value out of range names the field and the limit."""
    def serve(*flags: str) -> ServiceConfig:
        return ServiceConfig.from_args(cli.build_parser().parse_args(["serve", "--model", "m", *flags]))

    assert serve() == ServiceConfig(model="m")
    config = serve("--max-queue", "7", "--age-rate", "inf", "--chunk-tokens", "0", "--max-queue-wait", "3")
    assert (config.max_queue, config.age_rate, config.chunk_tokens, config.wait_budget) == (7, float("inf"), 0, 3.0)
    assert ServiceConfig(model="m", request_timeout=10).wait_budget == 5.0
    assert ServiceConfig(model="m", device="cuda:0, cuda:1").devices == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="device must name at least one device"):
        ServiceConfig(model="m", device=" , ")
    config = serve("--stall-timeout", "5", "--device-grace", "9")
    assert (config.stall_timeout, config.device_grace) == (5.0, 9.0)
    for field, value, limit in (("max_queue", 0, "> 0"), ("age_rate", 0.0, "> 0"),
                                ("stall_timeout", 0.0, "> 0"), ("device_grace", -1.0, "> 0"),
                                ("on_overflow", "drop", "one of truncate, reject")):
        with pytest.raises(ValueError, match=f"{field} must be {limit}"):
            ServiceConfig(model="m", **{field: value})
