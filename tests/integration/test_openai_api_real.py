"""The OpenAI features that need llama.cpp itself (prompt logits, its sampler chain, its templates), through
the official `openai` client against `cobali serve` on the embedded model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
from openai import OpenAI

import cobali
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.frontend.chat_template import JinjaChatTemplate
from tests.integration.test_server_openai import PROMPT, running_server

TOOLS_TEMPLATE = Path(cobali.__file__).parent / "templates" / "chatml_tools.jinja"


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with running_server("--max-slots", "4", "--served-model-name", "smol") as (base, _proc):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def backend(model_path: str) -> Iterator[LlamaCppBackend]:
    """The model itself, for its tokenizer and templates."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path=model_path, n_ctx=64, n_seq_max=1, n_threads=1))
    yield backend
    backend.close()


def test_echo_scores_the_prompt_like_generation_does(client: OpenAI) -> None:
    """The logprob the prompt's last token gets under echo is the one generation gives it from the prefix."""
    greedy = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    scored = client.completions.create(model="smol", prompt=PROMPT + greedy.text, max_tokens=1, temperature=0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(PROMPT + greedy.text)
    assert lp.token_logprobs[0] is None and len(lp.tokens) == scored.usage.prompt_tokens + 1
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    last_prompt_token = scored.usage.prompt_tokens - 1
    assert lp.tokens[last_prompt_token] == greedy.text
    # Different batch shapes: equal up to llama.cpp's numerics, not bit for bit.
    assert lp.token_logprobs[last_prompt_token] == pytest.approx(greedy.logprobs.token_logprobs[0], abs=0.05)


def test_logit_bias_reaches_llama_cpp_sampling(client: OpenAI, backend: LlamaCppBackend) -> None:
    [token] = backend.tokenize("Hello", add_special=False)
    # Sampled through llama.cpp's chain (temperature > 0), not the greedy shortcut.
    text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0.7, seed=1,
                                     logit_bias={str(token): 100}, extra_body={"ignore_eos": True}).choices[0].text
    assert text == "HelloHelloHello"


def test_the_models_jinja_template_matches_llama_cpps_matcher(backend: LlamaCppBackend) -> None:
    """Before Jinja, chat prompts came from llama.cpp's built-in matcher: a plain conversation must tokenize
    the same, token for token. Without a system message the two differ by design: SmolLM2's own template
    adds its default system turn, which the matcher (ChatML in general) does not know."""
    source = backend.chat_template_source()
    template = JinjaChatTemplate(source.text, source.bos_token, source.eos_token, source.adds_bos)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Name a colour."}]
    matcher = backend.apply_chat_template(conversation)
    assert backend.tokenize(template.render(conversation)) == backend.tokenize(matcher)
    default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    jinja = template.render(conversation[1:])
    assert jinja.startswith(default_system)
    assert backend.tokenize(jinja) == backend.tokenize(default_system + "<|im_end|>\n"
                                                       + backend.apply_chat_template(conversation[1:]))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "parameters": {"type": "object", "properties": {
        "people": {"type": "integer"}, "vegetarian": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def tool_client() -> Iterator[OpenAI]:
    with running_server("--max-slots", "2", "--served-model-name", "smol", "--chat-template",
                        str(TOOLS_TEMPLATE)) as (base, _proc):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "book_table"}}])
def test_a_forced_tool_call_is_valid_for_its_schema(tool_client: OpenAI, tool_choice) -> None:
    reply = tool_client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the weather in Paris for 3 days?"}],
        tools=[WEATHER, BOOK], tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "book_table": BOOK}[call.function.name]
    if isinstance(tool_choice, dict):
        assert call.function.name == "book_table"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_tool_result_goes_back_to_the_model(tool_client: OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    stream = tool_client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], temperature=0,
                                                 max_tokens=24, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks)


def test_embeddings_rank_a_paraphrase_above_an_unrelated_sentence(client: OpenAI) -> None:
    sentence = "The cat sat on the mat."
    texts = [sentence, "A cat was sitting on the rug.", "Quarterly revenue rose by eight percent.", sentence]
    response = client.embeddings.create(model="smol", input=texts)  # base64, decoded by the SDK
    vectors = np.array([d.embedding for d in response.data])
    cosine = vectors @ vectors.T / np.outer(np.linalg.norm(vectors, axis=1), np.linalg.norm(vectors, axis=1))
    assert cosine[0, 3] == pytest.approx(1.0, abs=1e-5)
    assert cosine[0, 1] > cosine[0, 2]
    assert response.usage.prompt_tokens > len(texts)
    # Alone, in another decode, the sentence embeds the same.
    alone = client.embeddings.create(model="smol", input=sentence, encoding_format="float").data[0].embedding
    assert float(np.dot(alone, vectors[0]) / np.linalg.norm(vectors[0])) == pytest.approx(1.0, abs=1e-4)


def test_embedding_inputs_share_decodes(backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    import cobali.backends.llama_cpp.embedder as module

    decoded: list[int] = []  # tokens per llama_decode
    decode = module.ll.llama_decode
    monkeypatch.setattr(module.ll, "llama_decode",
                        lambda ctx, batch: decoded.append(batch.n_tokens) or decode(ctx, batch))
    inputs = [backend.tokenize(f"Sentence number {i}.") for i in range(module.EMBEDDING_SEQS + 1)]
    vectors = backend.embed(inputs)
    assert decoded == [sum(map(len, inputs[:-1])), len(inputs[-1])]  # a decode holds EMBEDDING_SEQS inputs
    for index in (0, len(inputs) - 2):  # the first and the last of the shared decode, each embedded alone
        alone = backend.embed([inputs[index]])[0]
        cosine = np.dot(alone, vectors[index]) / np.linalg.norm(alone) / np.linalg.norm(vectors[index])
        assert cosine == pytest.approx(1.0, abs=1e-4)


def test_responses_api_on_the_real_model(client: OpenAI) -> None:
    response = client.responses.create(model="smol", input="Name a colour.", instructions="Answer in one word.",
                                       max_output_tokens=8, temperature=0)
    assert response.output_text and response.usage.output_tokens <= 8
    events = list(client.responses.create(model="smol", input="Name a colour.", instructions="Answer in one word.",
                                          max_output_tokens=8, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


@pytest.mark.slow  # LangChain's import alone takes seconds: run by .ci/run, not by `make test`
def test_langchain_chat_openai_binds_and_calls_a_tool(tool_client: OpenAI) -> None:
    import langchain_openai  # a dev dependency: missing, the test fails rather than skips

    def get_weather(city: str, days: int) -> str:
        """Current weather in a city, for some days."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(model="smol", base_url=str(tool_client.base_url), api_key="unused",
                                      temperature=0, max_tokens=60, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Rome for 2 days?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
    assert llm.invoke("Say hi.").content


def test_a_prompt_evicted_from_every_slot_comes_back_from_host_memory(client: OpenAI) -> None:
    """Four slots, and four other prompts after it take them all: the prompt's KV waits in host memory."""
    prompt = "In a quiet harbor town, the old fishermen told the children a story about a lighthouse that"

    def usage(text: str):
        return client.completions.create(model="smol", prompt=text, max_tokens=1, temperature=0).usage

    assert usage(prompt).prompt_tokens_details.cached_tokens == 0
    for word in ("apple", "river", "mountain", "violin"):
        usage(f"{word} " * 30)  # long enough to be cached
    again = usage(prompt)
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1
    metrics = httpx.get(f"{str(client.base_url).removesuffix('/v1/')}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("cobali:")}
    assert values["cobali:prefix_cache_host_hits_total"] >= again.prompt_tokens - 1
    assert values["cobali:host_cache_bytes"] > 0


def test_tokenize_counts_what_generation_bills_on_the_real_tokenizer(client: OpenAI) -> None:
    """The model's own template and tokenizer: /tokenize's count is the completion's and the chat's usage."""
    base = str(client.base_url).removesuffix("/v1/")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    for body, used in [
        ({"prompt": PROMPT}, client.completions.create(model="smol", prompt=PROMPT, max_tokens=1)),
        ({"messages": messages}, client.chat.completions.create(model="smol", messages=messages, max_tokens=1)),
    ]:
        reply = httpx.post(f"{base}/tokenize", json=body, timeout=30).json()
        assert reply["count"] == used.usage.prompt_tokens, body
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"] == PROMPT


def test_min_tokens_masks_the_end_token_in_llama_cpps_logits(client: OpenAI) -> None:
    """The ban is written into llama.cpp's own logits buffer, which its sampler chain reads: an end token biased
    to come first still waits for min_tokens."""
    base = str(client.base_url).removesuffix("/v1/")
    end = httpx.post(f"{base}/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert len(end) == 1
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    sampling = {"max_tokens": 24, "temperature": 0.7, "seed": 5, "logit_bias": {str(end[0]): 100}}
    short = client.chat.completions.create(model="smol", messages=messages, **sampling)
    assert (short.choices[0].finish_reason, short.choices[0].message.content) == ("stop", "")
    longer = client.chat.completions.create(model="smol", messages=messages, **sampling, extra_body={"min_tokens": 6})
    assert longer.choices[0].finish_reason == "stop" and longer.usage.completion_tokens > 6
    assert longer.choices[0].message.content


def test_speculative_decoding_through_the_server() -> None:
    """`cobali serve --num-speculative-tokens 3`: a greedy completion streamed and not streamed gives the same
    text (one configuration, one machine), as long as asked, and /metrics counts the guesses the model kept."""
    with running_server("--max-slots", "1", "--served-model-name", "smol", "--num-speculative-tokens", "3") as (
            base, _proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = {"model": "smol", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9,", "max_tokens": 24, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(**ask)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True) if c.choices)
        metrics = httpx.get(f"{base}/metrics").text
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    assert streamed == whole.choices[0].text
    name = "cobali:spec_decode_num_accepted_tokens_total"
    assert float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1]) > 0
