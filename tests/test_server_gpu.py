"""`clefcore serve --device cuda:0`: the server's whole path on a GPU (HTTP -> batcher -> device process ->
CUDA kernels) answers like the fp32 CPU engine, batches concurrent requests, and keeps serving after a bad
request. Skips without a GPU."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpu_only import HAVE_CUBLAS, HAVE_FP8, MARKS

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

from server_harness import GOLDEN, SUPPORT_TICKET, Server, check_client_rules, same_answers, ticket  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    import clefcore
    return clefcore.load(str(GOLDEN / "model"), device="cpu", context_length=24576)


# split8 with every GEMM on cuBLAS(Lt): at the golden model's small shapes the autotune would pick wmma and
# the fp8 pass would not run
PRECISIONS = [("split",), ("split8", "--gemm", "cublas")] if HAVE_FP8 and HAVE_CUBLAS else [("split",)]


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p[0])
def test_gpu_server_answers_like_the_cpu_engine(engine, precision):
    bodies = [json.loads(line) for line in (GOLDEN / "requests.jsonl").read_text().splitlines()]
    bodies += [ticket(f"Ticket {i}: checkout fails with error {i * 7} in region {i}.") for i in range(16)]
    # admission by the wait budget alone: the hook makes the device slow, and this tests the answers
    with Server("--device", "cuda:0", "--precision", *precision, "--max-batch-requests", "16",
                "--min-queue-wait", "1000", env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.2"}) as s:
        s.wait_ready(timeout=180)
        s.decide(SUPPORT_TICKET)        # keeps the device busy so the next ones queue up together
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(s.decide, bodies))
        answered = 0
        for body, reply in zip(bodies, replies):
            if reply.status == 422:     # golden requests that the Cloudflare rules refuse
                continue
            assert reply.status == 200, reply
            check_client_rules(body, reply.json())
            # GPU fp16 tensor cores vs the fp32 numpy path: probabilities within the engine's 2e-3 bar
            assert same_answers(reply.json(), engine.decide(body), tol=2e-3), body
            answered += 1
        assert answered >= 26
        assert s.metric("clef_batches_total") < len(bodies), "concurrent requests were never batched"
        assert s.metric("clef_device_memory_bytes") > 1e6       # the weights, at least (0 only on the CPU)
        bad = s.post("/v1/systemone", '{"state": "x", "questions": {}}')
        assert bad.status == 422
        assert s.decide(SUPPORT_TICKET).status == 200
        assert s.terminate() == 0
