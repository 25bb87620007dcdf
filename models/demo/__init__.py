"""The shipped demo models: where they live and what they are called.

The checkpoints (and their ONNX exports and report.json) are package data in this directory; the code
that trains and demonstrates them is `models.training`. Importing this module imports nothing heavy,
so the server and the exporter can name the demo files without pulling in training code.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
VISION_MULTIMAX = "digits_multimax.pt"
VISION_SOFTMAX = "digits_softmax.pt"
TEXT_MULTIMAX = "text_multimax.pt"
DEMO_FILES = (VISION_MULTIMAX, VISION_SOFTMAX, TEXT_MULTIMAX)
# The demo LLM: a Hugging Face-layout Llama folder with a SegLU head and a BPE tokenizer (models.training.llm).
LLM_DEMO = "llama_seglu"
