"""Former home of text generation, split into service.engine.scheduler (continuous batching),
service.engine.sampler (batched sampling, SamplingParams) and service.engine.text_detok (byte-level streaming
text). These names stay importable from here for code written against the old module; new code imports from the
modules themselves."""

from service.engine.sampler import SamplingParams, TokenLogprobs, TopLogprobs, token_logprobs
from service.engine.scheduler import GenSequence, TextScheduler
from service.engine.text_detok import TextStream

__all__ = ["GenSequence", "SamplingParams", "TextScheduler", "TextStream", "TokenLogprobs", "TopLogprobs",
           "token_logprobs"]
