"""`python -m benchmarks.tool_calls`: how many of the tool calls /v1/chat/completions returns parse and validate,
with the call grammar constraining generation and without it (what a server that parses the reply after the fact
returns).

`--model demo` (the default): the shipped demo LLM (models/demo/llama_seglu, a tiny Qwen-style chat model that was
never trained to call tools), served in this process through the HTTP API and read with the official `openai`
client. Per tool_choice (required, auto) and per setting, --requests sampled requests (seed i, temperature 1) ask
for the weather with one function tool (city: a string of at most 10 characters, unit: "c" or "f"). The settings:
"on", constrained by the call grammar; "frame", the call opened by the grammar (trigger, name, up to the
arguments) and its arguments left free (`service.protocols.tools.unconstrained(frame=True)`); "off", nothing
constrained and the reply parsed after the fact by the same parser (`tools.unconstrained()`: what a
parse-after-the-fact server returns). Counted: the calls the replies opened, the calls returned, those whose
`arguments` parse as JSON, those that also validate against the schema (jsonschema) and name the tool, the
requests that got at least one valid call, the finish reasons and the mean time per request; `-o` writes JSON.

`--model tuned`: a model that does write calls by itself. `build_tuned` makes it: a 2-layer Llama (transformers'
LlamaForCausalLM, hidden 128, 512 positions, the demo LLM's tokenizer and chat template) fine-tuned from random
weights (AdamW, seeded, CPU; --steps of 16 conversations) on synthetic conversations: three tools (weather, add,
search), a user's ask, and the assistant's turn `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
the loss on that turn only; the prompts are rendered by the server's own functions (read_tools,
prepare_messages, the template's render), so training and serving see the same ids. Then --requests asks whose
phrasings and values it never saw, with the three tools, per tool_choice (required, auto) and decoding (sampled:
seed i, temperature 1; greedy), constrained and unconstrained; each unconstrained reply is counted twice: as this
server's parser returns it, and as vLLM's Hermes parser would (`after_the_fact`, over the text the model wrote,
read from the logprobs). Counted besides: the replies that open a call (`<tool_call>` in the text), the calls
that name the tool asked for and those with the very values asked for.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME = "llama_seglu"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": SCHEMA}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def judge(call: Any) -> tuple[bool, bool]:
    """(its arguments parse as JSON, they also validate and the call names the tool)."""
    import jsonschema

    try:
        value = json.loads(call.function.arguments)
    except (json.JSONDecodeError, TypeError):
        return False, False
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return True, False
    return True, call.function.name == TOOL["function"]["name"]


SETTINGS = {"on": "constrained (the call grammar)", "frame": "the call opened by the grammar, arguments free",
            "off": "unconstrained, parsed after the fact"}


def run_cell(client: Any, choice: str, setting: str, requests: int, max_tokens: int,
             parallel: bool) -> dict[str, Any]:
    from service.protocols import tools

    opened = calls = parsed = valid = useful = 0
    finishes: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    with contextlib.nullcontext() if setting == "on" else tools.unconstrained(frame=setting == "frame"):
        for seed in range(requests):
            r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[TOOL], tool_choice=choice,
                                               max_tokens=max_tokens, seed=seed, temperature=1.0,
                                               parallel_tool_calls=parallel)
            choice_ = r.choices[0]
            finishes[str(choice_.finish_reason)] += 1
            judged = [judge(c) for c in choice_.message.tool_calls or ()]
            calls += len(judged)
            # a call the reply opened but never finished (cut, or not JSON) is left in the content
            opened += len(judged) + (choice_.message.content or "").count('{"name": ')
            parsed += sum(p for p, _ in judged)
            valid += sum(v for _, v in judged)
            useful += any(v for _, v in judged)
    seconds = time.perf_counter() - started
    return {"tool_choice": choice, "setting": setting, "requests": requests, "opened": opened, "calls": calls,
            "parse": parsed, "validate": valid, "requests_with_valid_call": useful, "finish_reasons": dict(finishes),
            "ms_per_request": round(1000 * seconds / requests, 1)}


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| tool_choice | generation | requests | calls opened | calls returned | parse | validate "
             "| requests with a valid call "
             "| finish reasons | ms / request |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        finishes = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        setting = SETTINGS[r["setting"]]
        useful = percent(r["requests_with_valid_call"], r["requests"])
        lines.append(f"| {r['tool_choice']} | {setting} | {r['requests']} | {r['opened']} | {r['calls']} | "
                     f"{percent(r['parse'], r['calls'])} | {percent(r['validate'], r['calls'])} | {useful} | "
                     f"{finishes} | {r['ms_per_request']} |")
    return "\n".join(lines)


# ---- a model that calls tools by itself: a 2-layer Llama fine-tuned here on the Hermes syntax ------------------

TUNED = "tool_llama"
DEMO_LLM = Path(__file__).resolve().parents[1] / "models" / "demo" / "llama_seglu"
CONTEXT = 512
TUNED_SCHEMAS: dict[str, dict[str, Any]] = {
    "weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]},
    "search": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
               "required": ["query", "limit"]},
}
DESCRIPTIONS = {"weather": "Current weather in a city", "add": "Add two integers", "search": "Search the web"}
TUNED_TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
               for n, s in TUNED_SCHEMAS.items()]
# What the user asks: phrasings and values for training ("train") and others for the measured requests ("test"),
# so every measured ask is new to the model (a new phrasing with a value it never saw).
CITIES = {"train": ["Paris", "Oslo", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Dublin", "Athens",
                    "Warsaw", "Zurich", "Tokyo", "Seoul", "Lima", "Quito", "Cairo", "Nairobi", "Delhi", "Hanoi",
                    "Sydney", "Denver", "Boston", "Austin", "Geneva", "Toronto", "Havana", "Manila"],
          "test": ["Helsinki", "Munich", "Kyoto", "Bogota", "Accra", "Perth", "Seattle", "Milan", "Riga", "Tunis"]}
TOPICS = {"train": ["cheap flights", "pasta recipes", "python tutorials", "jazz concerts", "used bikes",
                    "hiking trails", "tax forms", "dog training", "cheap hotels", "yoga classes", "movie times",
                    "car rentals", "garden tools", "piano lessons", "coffee shops", "bus routes"],
          "test": ["solar panels", "chess openings", "rain boots", "bird songs", "tea shops", "ski passes"]}
UNIT_WORDS = {"c": ["celsius", "Celsius", "degrees C"], "f": ["fahrenheit", "Fahrenheit", "degrees F"]}
PHRASINGS = {
    "train": {"weather": ["What is the weather in {city}, in {unit}?", "Weather for {city} please, {unit}.",
                          "How warm is it in {city}? Use {unit}.", "Tell me the temperature in {city} in {unit}."],
              "add": ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "Sum of {a} and {b}?"],
              "search": ["Search the web for {query}, {limit} results.", "Find {limit} pages about {query}.",
                         "Look up {query} (top {limit})."]},
    "test": {"weather": ["Is it cold in {city} right now? Answer in {unit}.", "{city} weather in {unit}?"],
             "add": ["How much is {a} and {b} together?", "Please add {a} to {b}."],
             "search": ["I need {limit} links on {query}.", "Show me {limit} results for {query}."]},
}


@dataclass(frozen=True)
class Ask:
    """A user's request and the call that answers it."""

    text: str
    name: str
    arguments: dict[str, Any]


def make_ask(rng: random.Random, split: str) -> Ask:
    """One ask of `split` ("train" or "test"): a random tool, phrasing and values."""
    name = rng.choice(list(TUNED_SCHEMAS))
    phrasing = rng.choice(PHRASINGS[split][name])
    if name == "weather":
        city, unit = rng.choice(CITIES[split]), rng.choice("cf")
        return Ask(phrasing.format(city=city, unit=rng.choice(UNIT_WORDS[unit])), name, {"city": city, "unit": unit})
    if name == "add":
        a, b = rng.randrange(1000), rng.randrange(1000)
        return Ask(phrasing.format(a=a, b=b), name, {"a": a, "b": b})
    query, limit = rng.choice(TOPICS[split]), rng.randint(1, 10)
    return Ask(phrasing.format(query=query, limit=limit), name, {"query": query, "limit": limit})


def measured_asks(requests: int, seed: int = 1) -> list[Ask]:
    """The measured asks (phrasings and values never trained on)."""
    rng = random.Random(seed)
    return [make_ask(rng, "test") for _ in range(requests)]


def served_prompt(tok: Any, tools_: list[dict[str, Any]], user: str) -> list[int]:
    """The prompt ids /v1/chat/completions feeds the model for one user message with `tools_`, made by the server's
    own functions as chat_api.chat_prompt makes it (read_tools, prepare_messages, the chat template's render)."""
    from service.protocols import tools
    from service.protocols.chat_template import render

    template = tok.chat_template
    plan = tools.read_tools(tools_, None, None, template=template)
    messages, extra = tools.prepare_messages([{"role": "user", "content": user}], template, plan)
    return list(tok.encode(render(template, messages, tok.special_texts(), add_generation_prompt=True, **extra),
                           bos=False))


def answer_text(ask: Ask) -> str:
    """The assistant's turn that calls: the Hermes syntax as the server's grammar writes it, then <|im_end|>."""
    from service.protocols.tool_grammar import HERMES

    return HERMES.call_text([(ask.name, json.dumps(ask.arguments, ensure_ascii=False))]) + "<|im_end|>"


def training_example(tok: Any, rng: random.Random) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one synthetic conversation: some of the tools (the one called among them, in a
    random order), a training ask, the call that answers it."""
    ask = make_ask(rng, "train")
    others = [t for t in TUNED_TOOLS if t["function"]["name"] != ask.name]
    offered = [t for t in TUNED_TOOLS if t["function"]["name"] == ask.name] + rng.sample(others, rng.randint(0, 2))
    rng.shuffle(offered)
    return served_prompt(tok, offered, ask.text), list(tok.encode(answer_text(ask), bos=False))


def build_tuned(out: Path, steps: int = 300, seed: int = 0, batch: int = 16, lr: float = 3e-3,
                threads: int = 1, log: Any = None) -> Path:
    """`out`/tool_llama: a 2-layer Llama (hidden 128, 4 heads, 2 KV heads, 512 positions; the demo LLM's tokenizer
    and chat template) fine-tuned from random weights with AdamW (seeded, CPU) on fresh synthetic conversations,
    the loss on the assistant's turn only, written with save_pretrained as a folder the server serves. `threads`:
    torch's intra-op threads while it trains (one is faster than two on a busy 2-core machine)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer

    folder = out / TUNED
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO_LLM / "tokenizer.json", folder / "tokenizer.json")
    config_json = json.loads((DEMO_LLM / "tokenizer_config.json").read_text())
    config_json["model_max_length"] = CONTEXT
    (folder / "tokenizer_config.json").write_text(json.dumps(config_json, indent=2))
    tok = HFTextTokenizer(HFTokenizer.from_folder(folder))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=int(tok.vocab_size), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         eos_token_id=0, pad_token_id=0, bos_token_id=None, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [0, 2]  # <|endoftext|>, <|im_end|>: the server ends a reply at either
    model.generation_config.pad_token_id = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _train(model, tok, rng, steps, batch, optimizer, schedule, log)
    finally:
        torch.set_num_threads(before)
    model.eval()
    model.save_pretrained(folder)
    return folder


def _train(model: Any, tok: Any, rng: random.Random, steps: int, batch: int, optimizer: Any, schedule: Any,
           log: Any) -> None:
    import torch

    for step in range(steps):
        examples = [training_example(tok, rng) for _ in range(batch)]
        length = max(len(p) + len(a) for p, a in examples)
        ids = torch.zeros((batch, length), dtype=torch.long)  # right-padded: causal attention never sees the pad
        labels = torch.full((batch, length), -100, dtype=torch.long)
        for row, (prompt, answer) in enumerate(examples):
            ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        target = labels[:, 1:]
        scored = target != -100  # the head only where the loss is: the assistant's turn
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]), target[scored])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log is not None and (step % 25 == 0 or step == steps - 1):
            print(f"step {step}: loss {loss.item():.3f}", file=log, flush=True)


# ---- measuring it ---------------------------------------------------------------------------------------------

CALL_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
TUNED_SETTINGS = {"on": "constrained (the call grammar)", "off": "unconstrained, this server's parser",
                  "fact": "unconstrained, vLLM's Hermes parser"}


def after_the_fact(text: str) -> list[tuple[str, str]]:
    """The calls a parse-after-the-fact server returns for a reply, as vLLM's Hermes parser does (its
    extract_tool_calls): every <tool_call> region (the last one may stay open to the end of the reply) json.loads-ed
    (strict=False: control characters allowed in strings), each object's "name" and its "arguments" re-serialized;
    one region that fails and the reply has no calls (its text is content). Names are not checked."""
    if "<tool_call>" not in text:
        return []
    try:
        objects = [json.loads(closed or open_, strict=False) for closed, open_ in CALL_REGION.findall(text)]
        calls = [(o["name"], json.dumps(o["arguments"], ensure_ascii=False)) for o in objects]
    except (ValueError, KeyError, TypeError, RecursionError):
        return []
    return calls if all(isinstance(n, str) for n, _ in calls) else []


def judge_tuned(name: str, arguments: str, ask: Ask) -> tuple[bool, bool, bool, bool]:
    """(the arguments parse as JSON, they also validate against the named tool's schema, the call names the tool
    asked for, and it is the call asked for: that tool with those values)."""
    import jsonschema

    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return False, False, name == ask.name, False
    if name not in TUNED_SCHEMAS:
        return True, False, False, False
    try:
        jsonschema.validate(value, TUNED_SCHEMAS[name])
    except jsonschema.ValidationError:
        return True, False, name == ask.name, False
    return True, True, name == ask.name, name == ask.name and value == ask.arguments


def raw_text(choice: Any) -> str:
    """The reply's text as the model wrote it (special tokens left out), from its logprobs' bytes."""
    return b"".join(bytes(t.bytes or ()) for t in choice.logprobs.content or ()).decode("utf-8", "replace")


def _empty_row(choice: str, decoding: str, setting: str, requests: int) -> dict[str, Any]:
    return {"tool_choice": choice, "decoding": decoding, "setting": setting, "requests": requests, "opened": 0,
            "requests_with_call": 0, "calls": 0, "parse": 0, "validate": 0, "right_tool": 0, "right_values": 0,
            "requests_with_valid_call": 0, "finish_reasons": collections.Counter(), "ms_per_request": None}


def _count(row: dict[str, Any], text: str, calls: list[tuple[str, str]], ask: Ask, finish: str) -> None:
    judged = [judge_tuned(n, a, ask) for n, a in calls]
    row["opened"] += "<tool_call>" in text
    row["requests_with_call"] += bool(calls)
    row["calls"] += len(judged)
    for i, key in enumerate(("parse", "validate", "right_tool", "right_values")):
        row[key] += sum(j[i] for j in judged)
    row["requests_with_valid_call"] += any(j[1] for j in judged)
    row["finish_reasons"][finish] += 1


def run_tuned_cell(client: Any, choice: str, decoding: str, constrained: bool, asks: list[Ask],
                   max_tokens: int, parallel: bool = True) -> list[dict[str, Any]]:
    """One tool_choice and decoding ("sampled": seed i, temperature 1; "greedy"), the asks sent with the three
    tools: constrained, one row; unconstrained, two rows from the same replies (this server's parser, and vLLM's
    over the text the model wrote, read from the logprobs)."""
    from service.protocols import tools

    rows = [_empty_row(choice, decoding, s, len(asks)) for s in (("on",) if constrained else ("off", "fact"))]
    temperature = 1.0 if decoding == "sampled" else 0.0
    started = time.perf_counter()
    with contextlib.nullcontext() if constrained else tools.unconstrained():
        for i, ask in enumerate(asks):
            r = client.chat.completions.create(
                model=TUNED, messages=[{"role": "user", "content": ask.text}], tools=TUNED_TOOLS,
                tool_choice=choice, max_tokens=max_tokens, seed=i, temperature=temperature,
                parallel_tool_calls=parallel, logprobs=True)
            c = r.choices[0]
            text = raw_text(c)
            served = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]
            _count(rows[0], text, served, ask, str(c.finish_reason))
            if not constrained:  # vLLM's finish reason: "tool_calls" when it parsed calls from a reply that ended
                calls = after_the_fact(text)
                ended = c.finish_reason in ("stop", "tool_calls")
                _count(rows[1], text, calls, ask, ("tool_calls" if calls else "stop") if ended else
                       str(c.finish_reason))
    ms = round(1000 * (time.perf_counter() - started) / len(asks), 1)
    for row in rows:
        row["finish_reasons"] = dict(row["finish_reasons"])
        row["ms_per_request"] = ms
    return rows


def tuned_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| tool_choice | decoding | generation and parser | requests | replies that open a call | requests with a "
             "call | calls returned | parse | validate | the tool asked for | the values asked for | requests with a "
             "valid call | finish reasons | ms / request |", "|---" * 14 + "|"]
    for r in rows:
        finishes = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        n, calls = r["requests"], r["calls"]
        lines.append(f"| {r['tool_choice']} | {r['decoding']} | {TUNED_SETTINGS[r['setting']]} | {n} | "
                     f"{percent(r['opened'], n)} | {percent(r['requests_with_call'], n)} | {calls} | "
                     f"{percent(r['parse'], calls)} | {percent(r['validate'], calls)} | "
                     f"{percent(r['right_tool'], calls)} | {percent(r['right_values'], calls)} | "
                     f"{percent(r['requests_with_valid_call'], n)} | {finishes} | {r['ms_per_request']} |")
    return "\n".join(lines)


def measure_tuned(folder: Path, requests: int, max_tokens: int, choices: tuple[str, ...] = ("required", "auto"),
                  decodings: tuple[str, ...] = ("sampled", "greedy"), parallel: bool = True,
                  log: Any = None) -> list[dict[str, Any]]:
    """The rows of the fine-tuned model in `folder`, served in this process over HTTP (the `openai` client)."""
    import openai

    from benchmarks.server import in_thread
    from service.base.config import Settings
    from service.edge.app import create_app

    asks = measured_asks(requests)
    rows: list[dict[str, Any]] = []
    app = create_app(Settings(model_dir=folder.parent, models=(folder.name,), warmup_calls=0))
    with in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for choice in choices:
            for decoding in decodings:
                for constrained in (True, False):
                    rows += run_tuned_cell(client, choice, decoding, constrained, asks, max_tokens, parallel)
                    if log is not None:
                        for row in rows[-1 if constrained else -2:]:
                            print(json.dumps(row), file=log, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tool_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("demo", "tuned"), default="demo",
                   help="demo: the shipped demo LLM (default); tuned: a 2-layer Llama fine-tuned here to call tools")
    p.add_argument("--requests", type=int, default=50, help="requests per cell (default 50)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per request (default 64 for the demo, whose context is 256 tokens; 128 for tuned)")
    p.add_argument("--no-parallel", action="store_true", help="parallel_tool_calls: false (default: true)")
    p.add_argument("--steps", type=int, default=300, help="tuned: fine-tuning steps of 16 conversations (300)")
    p.add_argument("--seed", type=int, default=0, help="tuned: the fine-tuning's seed")
    p.add_argument("--folder", help="tuned: build the model here (default: a temporary folder); an existing "
                                    "model folder there is served as it is")
    p.add_argument("-o", "--output", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.model == "tuned":
        return main_tuned(args)
    max_tokens = args.max_tokens or 64

    import openai

    from benchmarks.server import in_thread
    from service.base.config import Settings
    from service.edge.app import create_app

    rows = []
    with in_thread(create_app(Settings(models=(NAME,), warmup_calls=0))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for choice in ("required", "auto"):
            for setting in SETTINGS:
                rows.append(run_cell(client, choice, setting, args.requests, max_tokens,
                                     not args.no_parallel))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": NAME, "tool": TOOL, "max_tokens": max_tokens,
                       "parallel_tool_calls": not args.no_parallel, "rows": rows}, f, indent=2)
    return 0


def main_tuned(args: argparse.Namespace) -> int:
    import tempfile

    max_tokens = args.max_tokens or 128
    with contextlib.ExitStack() as stack:
        out = Path(args.folder) if args.folder else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder = out / TUNED
        started = time.perf_counter()
        if not (folder / "model.safetensors").is_file():
            build_tuned(out, steps=args.steps, seed=args.seed, log=sys.stderr)
        trained_s = round(time.perf_counter() - started, 1)
        print(f"fine-tuned in {trained_s} s", file=sys.stderr)
        rows = measure_tuned(folder, args.requests, max_tokens, parallel=not args.no_parallel, log=sys.stderr)
    print(tuned_table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": TUNED, "steps": args.steps, "seed": args.seed, "fine_tune_s": trained_s,
                       "tools": TUNED_TOOLS, "max_tokens": max_tokens, "parallel_tool_calls": not args.no_parallel,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
