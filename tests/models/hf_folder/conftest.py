"""The Hugging Face folders of every architecture, built once per session, loaded by this project and by transformers;
tiny models on one thread without gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models.hf_folder import load_folder  # noqa: E402
from models.llama import Llama  # noqa: E402
from tests.models.hf_folder.reference import Reference, arch_configs, make_folder, table8, train_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread_no_grad():
    """Tiny models gain nothing from intra-op threads (on a busy machine OpenMP barriers make them crawl)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    train_tokenizer(root / "tokenizer")
    return {name: make_folder(root / name, root / "tokenizer", config, **how)
            for name, (config, how) in arch_configs().items()}


@pytest.fixture(scope="session")
def loaded(hf_folders: dict[str, Path]) -> dict[str, tuple[Llama, Any, Reference]]:
    out = {}
    for name, folder in hf_folders.items():
        model, info = load_folder(folder)
        how = arch_configs()[name][1]
        ref = Reference(folder, table8(5), {i: table8(i) for i in how["attention_layers"]})
        out[name] = (model, info, ref)
    return out
