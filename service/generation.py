"""Former home of text generation, split into service.scheduler (continuous batching), service.sampler (batched
sampling, SamplingParams) and service.text_detok (byte-level streaming text). These names stay importable from
here for code written against the old module; new code imports from the modules themselves."""

from service.sampler import SamplingParams, TokenLogprobs, TopLogprobs, token_logprobs
from service.scheduler import GenSequence, TextScheduler
from service.text_detok import TextStream

__all__ = ["GenSequence", "SamplingParams", "TextScheduler", "TextStream", "TokenLogprobs", "TopLogprobs",
           "token_logprobs"]
