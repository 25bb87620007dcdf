"""What the demo models' training depends on, as one hash per model kind.

`python -m models.training train demos` records these in `models/demo/report.json`; the slow retraining tests run
only when the current hash differs from the recorded one (the training code, the data or the software
changed), so CI does not spend ten minutes re-proving what the shipped models already prove.
Code is hashed by its syntax tree without docstrings, so comments and wording do not count as changes.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path

import numpy as np
import sklearn
import torch

MODELS = Path(__file__).resolve().parents[1]
# The modules whose code decides the trained weights, per kind (paths relative to models/).
SOURCES = {
    "vision": ("training/vision.py", "training/digit_inputs.py", "training/drawn_digits.py",
               "training/optim.py", "deit.py", "multimax.py"),
    "text": ("training/text.py", "training/optim.py", "gpt.py", "multimax.py", "tokenizer.py"),
    # the demo LLM: its trainer and folder writer, the corpus (text.py), the model and what its forward imports
    "llm": ("training/llm.py", "training/llm_folder.py", "training/text.py", "llama.py", "gpt.py", "multimax.py",
            "attention_function.py", "cache_growth.py"),
}


def code_digest(path: Path) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def data_identity(kind: str) -> str:
    if kind == "vision":
        from sklearn.datasets import load_digits

        digits = load_digits()
        return "digits:" + hashlib.sha256(np.ascontiguousarray(digits.images).tobytes()
                                          + digits.target.tobytes()).hexdigest()
    # The docstrings of this Python's standard library: the Python version names the corpus.
    return f"stdlib-docstrings:python{sys.version_info.major}.{sys.version_info.minor}"


def training_fingerprint(kind: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES[kind]:
        h.update(f"{name}:{code_digest(MODELS / name)}\n".encode())
    h.update(f"{data_identity(kind)}\ntorch {torch.__version__}\nsklearn {sklearn.__version__}\n".encode())
    if kind == "llm":  # its BPE tokenizer is trained by `tokenizers` (and safetensors writes the weights)
        import safetensors
        import tokenizers

        h.update(f"tokenizers {tokenizers.__version__}\nsafetensors {safetensors.__version__}\n".encode())
    return h.hexdigest()[:16]


def fingerprints() -> dict[str, str]:
    return {kind: training_fingerprint(kind) for kind in SOURCES}
