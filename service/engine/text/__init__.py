"""Text generation: continuous batching of one text model, in the manner of vLLM's `EngineCore.step`.

A step is planned (`policy`: admission, burst gathering, chunking; a plain `StepPlan`), run (`runner`: the model
call over the `batch`'s rows and cache, sampling with `sampler`, stop strings and logprobs), and committed (the
`scheduler`'s loop hands each sequence its `SequenceDelta`). `detokenizer` turns a sequence's tokens into text as
they come.
"""

from service.engine.text.detokenizer import IncrementalDetokenizer
from service.engine.text.sampler import SamplingParams, TokenLogprobs, TopLogprobs, token_logprobs
from service.engine.text.scheduler import GenSequence, TextScheduler

__all__ = ["GenSequence", "IncrementalDetokenizer", "SamplingParams", "TextScheduler", "TokenLogprobs",
           "TopLogprobs", "token_logprobs"]
