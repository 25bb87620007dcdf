"""One generation request for every text endpoint (service.protocols.generation_request): /v1/completions and
/v1/chat/completions each build it from their own body, with the same checks in the same order; the one stream
writer (service.protocols.generation) leaves only the chunks' shape to each protocol."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.base.errors import ServiceError
from service.protocols import chat_api, generation, generation_request, openai_api
from service.protocols.generation_request import SamplingOptions


def _chat(**fields: Any) -> chat_api.ChatCompletionRequest:
    return chat_api.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _completion(**fields: Any) -> openai_api.CompletionRequest:
    return openai_api.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def _runtime(context: int = 32) -> Any:
    tokenizer = ByteTokenizer()
    return SimpleNamespace(tokenizer=tokenizer, context_length=context)


def test_chat_fields_map_to_the_completion_names() -> None:
    options = chat_api.sampling_options(_chat(max_tokens=3, max_completion_tokens=5, logprobs=True, top_logprobs=2,
                                              n=2, stop="x", seed=4, stream=True,
                                              stream_options={"include_usage": True}))
    assert (options.max_tokens, options.logprobs, options.n, options.best_of, options.echo) == (5, 2, 2, None, False)
    assert (options.stop, options.seed, options.stream, options.include_usage) == ("x", 4, True, True)
    assert chat_api.sampling_options(_chat(max_tokens=3)).max_tokens == 3
    assert chat_api.sampling_options(_chat(logprobs=True)).logprobs == 0
    assert chat_api.sampling_options(_chat()).logprobs is None
    with pytest.raises(ServiceError, match="top_logprobs needs logprobs"):
        chat_api.sampling_options(_chat(top_logprobs=2))


def test_both_bodies_give_the_same_options_for_the_same_fields() -> None:
    shared = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "n": 2, "stop": ["a"], "seed": 1, "min_tokens": 1,
              "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
              "logit_bias": {"5": 1.0}, "ignore_eos": True}
    chat = chat_api.sampling_options(_chat(max_completion_tokens=4, **shared))
    completion = _completion(max_tokens=4, **shared)
    assert completion.options(
        max_tokens=4, temperature=completion.temperature, top_p=completion.top_p, top_k=completion.top_k,
        n=completion.n, best_of=None, stop=completion.stop, seed=completion.seed, logprobs=None, echo=False,
        stream=False, stream_options=None).__dict__ | {"structured": None} == chat.__dict__ | {"structured": None}


def test_build_checks_in_one_order_and_blames_the_prompt_field() -> None:
    rt, settings = _runtime(context=8), Settings(warmup_calls=0)

    def build(prompt: list[int], **fields: Any) -> generation_request.GenerationRequest:
        return asyncio.run(generation_request.build([prompt], SamplingOptions(**fields), rt, settings,
                                                    default_max_tokens=16, prompt_field="messages"))

    req = build([1, 2, 3], n=2, seed=9, logprobs=1)
    assert (req.n, req.best_of, req.params[0].max_tokens, req.params[0].logprobs) == (2, 2, 5, 1)  # what fits
    with pytest.raises(ServiceError) as too_long:
        build(list(range(8)))
    assert too_long.value.param == "messages" and too_long.value.code == "context_length_exceeded"
    with pytest.raises(ServiceError) as both:  # choices are judged before logit_bias, as on either endpoint
        build([1], n=2, best_of=1, logit_bias={"x": 1.0})
    assert both.value.param == "best_of"


class _Shape(generation.ResponseFormat):
    object, chunk_object, id_prefix = "o", "c", "p"

    def choice(self, index: int, seq: Any) -> dict[str, Any]:
        return {"index": index}

    def entries(self, index: int, seq: Any, texts: list[tuple[str, int]], finished: bool) -> list[dict[str, Any]]:
        return [{"index": index, "text": t} for t, _ in texts]


def test_a_protocol_shapes_only_its_choices() -> None:
    """What a protocol must say is its objects' names, a whole choice and a chunk's entries; the opening chunk and
    the usage riding on the last one are optional."""
    shape = _Shape()
    assert shape.opening(0) == [] and not shape.usage_on_last_chunk
    assert chat_api.ChatFormat.usage_on_last_chunk is False and openai_api.CompletionFormat.usage_on_last_chunk
