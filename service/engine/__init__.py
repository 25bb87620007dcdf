"""The engine layer: runs models (backends, runtimes, the batcher, the text scheduler, the sampler, the KV
cache, detokenizers, model loading and checks). It raises its own errors and knows no web framework; it imports
only service.base (tests/service/test_layers.py)."""
