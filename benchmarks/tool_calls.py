"""`python -m benchmarks.tool_calls`: how many of the tool calls /v1/chat/completions returns parse and validate,
with the call grammar constraining generation and without it (what a server that parses the reply after the fact
returns).

The model: the shipped demo LLM (models/demo/llama_seglu, a tiny Qwen-style chat model that was never trained to
call tools; its template has no tool support, so the server writes the tools into the system message and asks
for the Hermes syntax), served in this process through the HTTP API and read with the official `openai` client.
Per tool_choice (required, auto) and per setting, --requests sampled requests (seed i, temperature 1) ask for the
weather with one function tool (city: a string of at most 10 characters, unit: "c" or "f"). The settings: "on",
constrained by the call grammar; "frame", the call opened by the grammar (trigger, name, up to the arguments) and
its arguments left free (`service.protocols.tools.unconstrained(frame=True)`); "off", nothing constrained and the
reply parsed after the fact by the same parser (`tools.unconstrained()`: what a parse-after-the-fact server
returns). Counted: the calls the replies opened, the calls returned, those whose `arguments` parse as JSON,
those that also validate against the schema (jsonschema) and name the tool, the requests that got at least one
valid call, the finish reasons and the mean time per request; `-o` writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tool_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=50, help="requests per tool_choice and setting (default 50)")
    p.add_argument("--max-tokens", type=int, default=64, help="per request (the demo's context is 256 tokens)")
    p.add_argument("--no-parallel", action="store_true", help="parallel_tool_calls: false (default: true)")
    p.add_argument("-o", "--output", help="write the results as JSON here")
    args = p.parse_args(argv)

    import openai

    from benchmarks.server import in_thread
    from service.base.config import Settings
    from service.edge.app import create_app

    rows = []
    with in_thread(create_app(Settings(models=(NAME,), warmup_calls=0))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for choice in ("required", "auto"):
            for setting in SETTINGS:
                rows.append(run_cell(client, choice, setting, args.requests, args.max_tokens,
                                     not args.no_parallel))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": NAME, "tool": TOOL, "max_tokens": args.max_tokens,
                       "parallel_tool_calls": not args.no_parallel, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
