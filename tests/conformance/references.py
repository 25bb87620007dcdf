"""Each kind's outside reference: next-token log-probabilities over a prompt, the prompt's ids, greedy text.

- Hugging Face kinds: transformers' own model of the folder (which drops the SegLU tensors, so the SegLU is
  applied to its logits here, from the paper's formula), and transformers' own tokenizer;
- fairseq kinds: fairseq's own full-forward log-probabilities and greedy words, recorded when the fixture was
  trained (tests/fixtures/fairseq/*/expected.*), on the fixture's own prompts;
- the project's byte-level GPT: its PyTorch model (the project's own: no outside implementation exists).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tests.conformance.builders import FAIRSEQ, SEGLU_RANGES, SEGLU_TS
from tests.conformance.matrix import Kind

GREEDY_TOKENS = 6


def seglu(x: torch.Tensor) -> torch.Tensor:
    r, t = SEGLU_RANGES, SEGLU_TS
    return (x + t[0] * torch.relu(r[0] - x) + t[1] * torch.relu(x - r[1]) + t[2] * torch.relu(r[2] - x) ** 2
            + t[3] * torch.relu(x - r[3]) ** 2)


@dataclass
class Case:
    prompt: str
    ids: list[int]  # the prompt as the reference tokenizes it (bos included where the tokenizer adds one)
    logprobs: np.ndarray  # (len(ids), vocab): log-probabilities of the next token after each position
    greedy_text: str  # greedy continuation, GREEDY_TOKENS at most, ended by an end-of-sequence token
    greedy_ids: list[int]  # likewise, without ending at eos
    eos: frozenset[int] = frozenset()  # the ids that end a sequence
    chat_text: str | None = None  # greedy reply to CHAT_MESSAGES through the chat template
    token_text: dict[int, str] | None = None
    lead: int = 0  # how many of `ids` the tokenizer puts before the text (a bos; fairseq's </s>)
    decoded: str | None = None  # `ids` decoded by the reference's tokenizer, special tokens kept


CHAT_MESSAGES = [{"role": "user", "content": "Return the number"}]


class Reference:
    """One kind's reference: its cases (prompts) and, where it can, logits for any ids."""

    def __init__(self, kind: Kind, source: Path) -> None:
        self.kind = kind
        if kind.builder == "hf":
            self.cases = _hf_cases(kind, source)
        elif kind.builder == "fairseq":
            self.cases = _fairseq_cases(kind)
        else:
            self.cases = _gpt_cases(source)


def _greedy(next_logprobs: object, ids: list[int], eos: set[int], steps: int) -> tuple[list[int], list[int]]:
    """(tokens up to eos, tokens ignoring eos) of greedy decoding with a full forward each step."""
    out: list[int] = []
    for _ in range(steps):
        row = next_logprobs([*ids, *out])  # type: ignore[operator]
        out.append(int(np.argmax(row)))
    stopped: list[int] = []
    for t in out:
        if t in eos:
            break
        stopped.append(t)
    return stopped, out


def _hf_cases(kind: Kind, folder: Path) -> list[Case]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seglu_on = bool(kind.options.get("seglu"))

    @torch.no_grad()
    def all_logprobs(ids: list[int]) -> np.ndarray:
        logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(seglu(logits) if seglu_on else logits, -1).numpy()

    eos = {int(tok.eos_token_id)}
    cases = []
    for prompt in ("Return the", "If the file"):
        ids = list(tok(prompt)["input_ids"])
        stopped, raw = _greedy(lambda x: all_logprobs(x)[-1], ids, eos, GREEDY_TOKENS)
        case = Case(prompt, ids, all_logprobs(ids), tok.decode(stopped, skip_special_tokens=True), raw,
                    frozenset(eos))
        if kind.chat:
            chat_ids = list(tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
            reply, _ = _greedy(lambda x: all_logprobs(x)[-1], chat_ids, eos, GREEDY_TOKENS)
            case.chat_text = tok.decode(reply, skip_special_tokens=True)
        case.token_text = {i: tok.decode([i]) for i in set(raw)}
        case.lead = len(ids) - len(tok(prompt, add_special_tokens=False)["input_ids"])
        case.decoded = tok.decode(ids, skip_special_tokens=False)
        cases.append(case)
    return cases


def _fairseq_cases(kind: Kind) -> list[Case]:
    folder = FAIRSEQ / kind.options["fixture"]
    expected = json.loads((folder / "expected.json").read_text())
    arrays = np.load(folder / "expected.npz")
    cases = []
    for i, c in enumerate(expected["cases"][:2]):
        words = c["greedy_words"].split(" ") if c["greedy_words"] else []
        if kind.word_level:
            stopped_words = []
            for w in words:
                if w == "</s>":
                    break
                stopped_words.append(w)
            greedy = "".join(" " + w for w in stopped_words)
        else:  # GPT-2 BPE: greedy_words is the decoded text (eos, id 2, ends it)
            ids = c["greedy_ids"]
            greedy = c["greedy_words"] if 2 not in ids else None  # type: ignore[assignment]
        assert c["ids"][0] == 2  # fairseq's LM input starts with </s>
        cases.append(Case(c["text"], list(c["ids"]), arrays[f"logprobs_{i}"], greedy, list(c["greedy_ids"]),
                          frozenset({2}), lead=1))  # fairseq's </s>
    return cases


def _gpt_cases(checkpoint: Path) -> list[Case]:
    from models import checkpoint as ckpt_io
    from models.tokenizer import ByteTokenizer

    model, _, _ = ckpt_io.load(checkpoint)
    model.eval()
    tok = ByteTokenizer()

    @torch.no_grad()
    def all_logprobs(ids: list[int]) -> np.ndarray:
        logits, _ = model(torch.tensor([ids]))
        return torch.log_softmax(logits[0].float(), -1).numpy()

    cases = []
    for prompt in ("Return the", "If the file"):
        ids = tok.encode(prompt)
        stopped, raw = _greedy(lambda x: all_logprobs(x)[-1], ids, {tok.eos_id}, GREEDY_TOKENS)
        cases.append(Case(prompt, ids, all_logprobs(ids), tok.decode(stopped), raw, frozenset({tok.eos_id}),
                          token_text={i: tok.decode([i]) for i in set(raw)}))
    return cases
