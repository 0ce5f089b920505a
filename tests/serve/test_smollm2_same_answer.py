"""Same request, same answer (issue 48), over real HTTP on the real default model: SmolLM2-135M
served from its Q4_1 GGUF by granian, with the official openai client.

What a new user saw part before: the France question alone and among eight concurrent streams
(the contract's `concurrent_streams_equal_serial`), a chat request and the completion of its
rendered template (the second finds the prompt in the prefix cache), a request streamed and
not (greedy, and seeded sampling), and an embeddings input alone and inside a large batch. Each
pair must agree bit for bit: text, token logprobs, vectors. The server runs the default
scheduling (prefix cache, several decode steps per call, overlap for one sequence, the kernels
its start-up measurement chose) over a few step buckets, so that it compiles in reasonable time.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.granian_server import serving_model

pytestmark = pytest.mark.slow

FRANCE = "What is the capital of France?"
QUESTIONS = [
    FRANCE,
    "Name a fruit.",
    "Write a Python function that adds two numbers.",
    "Translate to French: the light of the morning.",
    "Why is the sky blue?",
    "Count to ten.",
    "Décris le café crème à Genève.",
    "你好 🙂 how are you?",
]


@pytest.fixture(scope="module")
def server(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    engine = (
        "num_kv_blocks = 512\nmax_num_seqs = 8\nmax_num_batched_tokens = 256\nprefill_chunk = 256\n"
        "token_buckets = [8, 64, 256]\nseq_buckets = [1, 8]\n"
    )
    with serving_model(smol_dir, tmp_path_factory.mktemp("smol-same"), engine) as url:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0) as c:
            yield c, url


def _chat(client: openai.OpenAI, q: str, **kw: Any) -> tuple[str, list[float], Any]:
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": q}], max_tokens=16, logprobs=True, **kw
    )
    c = r.choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    return c.message.content or "", [t.logprob for t in c.logprobs.content], r.usage


def _streamed(client: openai.OpenAI, q: str, **kw: Any) -> tuple[str, list[float]]:
    text, lps = "", []
    for chunk in client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": q}], max_tokens=16, logprobs=True, stream=True, **kw
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                lps += [t.logprob for t in chunk.choices[0].logprobs.content]
    return text, lps


def test_eight_concurrent_streams_equal_the_serial_answers(server: tuple[openai.OpenAI, str]) -> None:
    client, _ = server
    serial = [_chat(client, q, temperature=0)[:2] for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: _streamed(client, q, temperature=0), QUESTIONS))
    for q, alone, many in zip(QUESTIONS, serial, together, strict=True):
        assert many == alone, q


def test_chat_equals_the_completion_of_its_rendered_template(server: tuple[openai.OpenAI, str]) -> None:
    """The completion of exactly the chat's prompt tokens finds them in the prefix cache and
    computes only the last ones: the same text and logprobs."""
    client, base = server
    q = "Translate into French: the light of the morning is soft."
    text, lps, usage = _chat(client, q, temperature=0)
    ids = httpx.post(f"{base}/tokenize", json={"model": "smol", "messages": [{"role": "user", "content": q}]}).json()
    r = client.completions.create(model="smol", prompt=ids["tokens"], max_tokens=16, temperature=0, logprobs=1)
    assert r.usage is not None and r.usage.prompt_tokens == usage.prompt_tokens
    details = r.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0  # served partly from the cache
    assert r.choices[0].text == text
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.token_logprobs == lps


@pytest.mark.parametrize("q", [FRANCE, QUESTIONS[6], QUESTIONS[7]], ids=["ascii", "accents", "cjk_emoji"])
def test_streamed_equals_not_streamed_greedy_and_seeded(server: tuple[openai.OpenAI, str], q: str) -> None:
    client, _ = server
    assert _streamed(client, q, temperature=0) == _chat(client, q, temperature=0)[:2]
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    assert _chat(client, q, **seeded)[:2] == _streamed(client, q, **seeded)


def test_an_embeddings_input_alone_and_in_a_batch(server: tuple[openai.OpenAI, str]) -> None:
    client, _ = server
    text = "The cat sat on the mat."
    alone = client.embeddings.create(model="smol", input=text).data[0].embedding
    batch = [f"filler sentence number {i} of a large batch." * (1 + i % 3) for i in range(127)]
    batch.insert(100, text)
    got = client.embeddings.create(model="smol", input=batch).data
    assert got[100].embedding == alone
    assert client.embeddings.create(model="smol", input=[text, text[:-1]]).data[0].embedding == alone
