"""Each tool-call family served end to end (issue 41): a model folder whose chat template speaks Llama 3.1's JSON
calls (`<|python_tag|>`, the `ipython` role), Mistral v0.3's `[TOOL_CALLS]` (a special token of its vocabulary),
the shipped demo LLM's ChatML with Qwen 2.5's Hermes `<tool_call>`, and plain ChatML without tool support (the
server writes the tools into the system message and asks for the Hermes syntax). The syntax is chosen from the
template alone (service.protocols.tool_grammar); the tools and the conversation reach each template as
transformers passes them (the rendering equals transformers' apply_chat_template); with tool_choice required the
reply is one call whose arguments parse and validate, finish_reason "tool_calls", whole and streamed alike.

The models: tiny Llamas with random weights written by transformers' save_pretrained, the demo LLM's tokenizer
with each family's special tokens added (Mistral's folder is a LlamaForCausalLM too: the server serves llama,
qwen2 and qwen3 model types, and Mistral v0.3's architecture is Llama's). Minimal templates, written here after
the families' own; random weights write noise unconstrained, so every well-formed call is the grammar's doing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.server import in_thread
from models.demo import DEMO_DIR
from models.training.llm_folder import CHAT_TEMPLATE as DEMO_TEMPLATE
from service.base.config import Settings
from service.edge.app import create_app
from service.protocols import tools
from service.protocols.chat_template import render
from service.protocols.tool_grammar import HERMES, LLAMA3_JSON, MISTRAL, CallSyntax, syntax_for_template

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
torch = pytest.importorskip("torch")

LLM = "llama_seglu"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
ASK: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]

# Llama 3.1's layout: tools in the system turn after "Environment: ipython", calls as {"name", "parameters"},
# results in the ipython role; <|python_tag|> opens a built-in tool's code (not used here).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n\\nAnswer with a function call as JSON: {\"name\": function name, "
    "\"parameters\": dictionary of its arguments}. The functions:\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message['tool_calls'] %}{%- set f = call['function'] %}"
    "{{- '{\"name\": \"' + f['name'] + '\", \"parameters\": ' + (f['arguments'] | tojson) + '}' }}{%- endfor %}"
    "{{- '<|eom_id|>' }}"
    "{%- elif message['role'] in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- elif message['role'] == 'assistant' and message['content'].startswith('<|python_tag|>') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message['content'] + '<|eom_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Mistral v0.3's layout: [AVAILABLE_TOOLS] before the last user turn, the system message before the last user
# message's text, calls after the [TOOL_CALLS] token with 9-character ids (the template refuses others), results
# in [TOOL_RESULTS] with the call's id.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and message == users[-1] %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- if system is defined and message == users[-1] %}{{- '[INST] ' + system + '\\n\\n' + message['content'] "
    "+ '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['id'] is not defined or call['id'] | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] "
    "| tojson) + ', \"id\": \"' + call['id'] + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message['content'] | tojson) + ', \"call_id\": \"' "
    "+ message['tool_call_id'] + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}{%- endif %}"
    "{%- endfor %}")

# The shipped demo LLM's template before it rendered tools: plain ChatML
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")

# name -> (template, special tokens added to the demo's tokenizer, bos, eos, the syntax, whether it is native)
FAMILIES: dict[str, tuple[str, list[str], str | None, str, CallSyntax, bool]] = {
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                 "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", LLAMA3_JSON,
               True),
    "mistral": (MISTRAL_TEMPLATE, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>",
                MISTRAL, True),
    "hermes": (DEMO_TEMPLATE, [], None, "<|im_end|>", HERMES, True),
    "chatml": (CHATML, [], None, "<|im_end|>", HERMES, False),
}
MARKERS = {"llama3": "Environment: ipython", "mistral": "[AVAILABLE_TOOLS]", "hermes": "# Tools\n",
           "chatml": "Functions you may call:"}


def make_folder(out: Path, family: str) -> Path:
    """A tiny random Llama (transformers' save_pretrained) with the demo LLM's tokenizer, the family's special
    tokens added, and its template."""
    from tokenizers import AddedToken, Tokenizer

    template, specials, bos, eos, _, _ = FAMILIES[family]
    tok = Tokenizer.from_file(str(DEMO_DIR / LLM / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                pad_token="<|endoftext|>", chat_template=template)
    size = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.LlamaConfig(vocab_size=size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                      pad_token_id=fast.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_folder(root / family, family)
    return root


@pytest.fixture(scope="module")
def url(folders: Path) -> Iterator[str]:
    # the folders on PyTorch, as they are: the templates and the grammar are tested here, not the folders' exports
    app = create_app(Settings(model_dir=folders, models=tuple(FAMILIES), backend="torch", warmup_calls=0,
                              intra_op_threads=1))
    with in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def validate(call: Any) -> None:
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_each_template_names_its_syntax() -> None:
    for family, (template, _, _, _, syntax, native) in FAMILIES.items():
        assert syntax_for_template(template) == (syntax, native), family
    shipped = json.loads((DEMO_DIR / LLM / "tokenizer_config.json").read_text())["chat_template"]
    assert shipped == DEMO_TEMPLATE  # the shipped folder's template is the one its writer writes


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f][5]])
def test_tools_and_calls_render_as_transformers_renders_them(folders: Path, family: str) -> None:
    """The conversation as the server prepares it (service.protocols.tools.prepare_messages) through the template
    equals transformers' apply_chat_template of the same conversation (arguments as objects, Mistral's ids of 9
    characters, as transformers' users pass them)."""
    template = FAMILIES[family][0]
    theirs = transformers.AutoTokenizer.from_pretrained(folders / family)
    plan = tools.read_tools([WEATHER], "auto", None, template=template)
    assert plan is not None and plan.native
    messages, extra = tools.prepare_messages(HISTORY, template, plan)
    specials = {"bos": theirs.bos_token, "eos": theirs.eos_token, "pad": theirs.pad_token}
    ours = render(template, messages, specials, add_generation_prompt=True, **extra)
    call_id = "0000call1" if family == "mistral" else "call_1"
    hf_messages = [HISTORY[0], HISTORY[1],
                   {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
                       "name": "weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
                   {"role": "tool", "tool_call_id": call_id, "name": "weather", "content": "18 C"}]
    assert ours == theirs.apply_chat_template(hf_messages, tools=[WEATHER], tokenize=False,
                                              add_generation_prompt=True)
    assert MARKERS[family] in ours and '"city": "Paris"' in ours and "18 C" in ours


def test_the_demo_template_renders_a_conversation_without_tools_as_plain_chatml() -> None:
    """The shipped demo LLM gained tool support without changing any prompt it was served before."""
    specials = {"eos": "<|endoftext|>", "pad": "<|endoftext|>"}
    for messages in ([ASK[0]], [HISTORY[0], ASK[0], {"role": "assistant", "content": "Sunny."}, ASK[0]],
                     [{"role": "developer", "content": ""}, {"role": "user", "content": "<tool_call>\n{}"}]):
        for generation in (True, False):
            want = render(CHATML, messages, specials, add_generation_prompt=generation)
            assert render(DEMO_TEMPLATE, messages, specials, add_generation_prompt=generation) == want
            assert render(DEMO_TEMPLATE, messages, specials, add_generation_prompt=generation, tools=[]) == want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_served_prompt_is_the_familys(url: str, family: str) -> None:
    """/tokenize renders a chat's tools as chat does: the family's own tool block (or the server's, for plain
    ChatML), and chat's prompt_tokens count the same ids."""
    import httpx

    body = {"model": family, "messages": ASK, "tools": [WEATHER]}
    ids = httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"model": family, "tokens": ids}, timeout=60).json()["prompt"]
    assert MARKERS[family] in text and '"name": "weather"' in text
    assert sum(m in text for m in MARKERS.values()) == 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_required_call_parses_validates_and_streams_alike(client: Any, family: str) -> None:
    args = {"model": family, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    validate(call)
    prompt = whole.usage.prompt_tokens
    assert whole.usage.completion_tokens < 120 and prompt + 120 <= 1024

    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.content or "" for d in deltas) == ""
    opened = [tc for d in deltas for tc in d.delta.tool_calls or () if tc.id is not None]
    assert len(opened) == 1 and opened[0].function.name == "weather" and opened[0].function.arguments == ""
    grown = "".join(tc.function.arguments or "" for d in deltas for tc in d.delta.tool_calls or ()
                    if tc.id is None)
    assert grown == call.function.arguments


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_conversation_with_calls_and_results_goes_through_the_template(client: Any, family: str) -> None:
    """The call and its result sent back (Mistral's template refuses call ids that are not 9 characters: the
    server makes them from the client's), then auto: whatever the reply, any call in it validates."""
    r = client.chat.completions.create(model=family, messages=HISTORY, tools=[WEATHER], max_tokens=40,
                                       temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or ():
        validate(call)


def test_mistral_trigger_is_one_special_token_the_reply_keeps(folders: Path) -> None:
    """[TOOL_CALLS] is one token of the Mistral folder's vocabulary: the grammar names it by id and the parser
    still sees it (decoding drops special tokens)."""
    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer

    tok = HFTextTokenizer(HFTokenizer.from_folder(folders / "mistral"))
    token = tools.trigger_token(tok, MISTRAL)
    assert token is not None and token == tok.encode("[TOOL_CALLS]", bos=False)[0]
    plan = tools.read_tools([WEATHER], "required", False, template=MISTRAL_TEMPLATE)
    assert plan is not None and f"<[{token}]>" in tools.grammar_job(plan, tok).source

