"""docs/DEPLOY.md: every command block is run, carried out, parsed or visibly marked as a step no test runs, and
its configuration snippets agree with the files and the server they describe.

Each ```console block is preceded by `<!-- deploy-test: KIND -->`:
  run           its commands run as written (a `python -m service ... &` line starts the server on a free port,
                and `localhost:8000` in the other commands points to it); their output must show what the page
                shows (volatile numbers match any number, as in tests/project/test_readme.py);
  helm          `helm lint` / `helm template` carried out with Helm's own engine (helm-python-sdk), every
                rendered resource schema-validated (no helm binary, no cluster);
  ray           starts Ray: each `python -m service.ray` / `serve run service.ray:build` is parsed by the Ray
                entry point's own parser, each `pip install -e ".[extra]"` names an extra of pyproject.toml;
  cluster-only, docker-only
                not run; the block's first line says so to the reader. Their `helm install|upgrade` of the local
                chart are rendered with the values they set, their `python -m service.ray` parsed.
```promql blocks are checked against the server's /metrics like the dashboard; ```yaml blocks against the
adapter values, the Ray builder's parser and the chart's ServingRuntime.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest
import tomllib
import yaml

from benchmarks.server import start, stop
from service.edge.ray.options import argv_from_mapping, parse
from tests.deploy.support import (
    ROOT,
    Exposition,
    check_query,
    demo_client,
    exercised_exposition,
    render,
    validate,
)
from tests.project.test_readme import ANSI, matches, script

DOC = ROOT / "docs" / "DEPLOY.md"
ADAPTER_VALUES = ROOT / "deploy" / "helm" / "prometheus-adapter-values.yaml"
MARK = re.compile(r"<!-- deploy-test: (?P<kind>run|helm|ray|cluster-only|docker-only) -->")
# What the reader sees first in a block that no test runs as written.
HEADER = {"cluster-only": "# cluster-only:", "docker-only": "# Docker host only:", "ray": "# starts Ray:",
          "helm": "# the tests carry these out with Helm's own engine"}
PROMPT = re.compile(r"^(?:[\w-]*\$)\s+(?P<cmd>.*)$")
SERVER = re.compile(r"^python -m service(?P<args>(?: [^#&]*)?)&\s*(#.*)?$")


@dataclass
class Command:
    text: str
    expected: list[str]


@dataclass
class Block:
    line: int
    lang: str
    kind: str | None
    body: list[str]

    @property
    def commands(self) -> list[Command]:
        found: list[Command] = []
        lines = iter(self.body)
        for line in lines:
            m = PROMPT.match(line)
            if m:
                cmd = m["cmd"]
                while cmd.endswith("\\"):
                    cmd = cmd[:-1] + " " + next(lines).strip()
                found.append(Command(cmd, []))
            elif found and line.strip():
                found[-1].expected.append(line)
        return found

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.kind or self.lang}"


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w+)", lines[i].strip())
        if not m:
            i += 1
            continue
        mark = MARK.fullmatch(lines[i - 1].strip()) if i else None
        end = lines.index("```", i + 1)
        out.append(Block(i + 1, m.group(1), mark["kind"] if mark else None, lines[i + 1:end]))
        i = end + 1
    return out


BLOCKS = blocks(DOC.read_text())


def of(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def command_words(block: Block) -> list[list[str]]:
    """Each command as argv, environment assignments and trailing comments dropped."""
    out = []
    for c in block.commands:
        words = shlex.split(c.text, comments=True)
        while words and re.fullmatch(r"\w+=.*", words[0]):
            words.pop(0)
        out.append(words)
    return out


@pytest.fixture(scope="module")
def exposition() -> Exposition:
    with demo_client() as client:
        return exercised_exposition(client)


def test_every_command_block_is_marked_and_says_what_it_is() -> None:
    console = [b for b in BLOCKS if b.lang == "console"]
    assert console and all(b.kind for b in console), [b.id for b in console if not b.kind]
    assert {b.kind for b in console} == set(HEADER) | {"run"}
    for block in console:
        if block.kind in HEADER:
            assert block.body[0].startswith(HEADER[block.kind]), (block.id, block.body[0])
        assert block.commands, block.id


@pytest.mark.parametrize("block", of("run"), ids=lambda b: b.id)
def test_run_blocks_run_as_written(block: Block) -> None:
    commands, server = block.commands, None
    first = SERVER.match(commands[0].text)
    try:
        if first:  # the server in the background, on a port of its own
            server, url = start(*shlex.split(first["args"]), cwd=ROOT)
            commands = commands[1:]
        texts = [c.text.replace("localhost:8000", url.removeprefix("http://")) if server else c.text
                 for c in commands]
        proc = subprocess.run(["bash", "-c", script(texts)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        if server is not None:
            stop(server)
    output = ANSI.sub("", proc.stdout)
    for i, command in enumerate(commands):
        segment = output.split(f"@@CMD {i}\n", 1)[1].split("\n@@RC ", 1)
        assert int(segment[1].split("\n", 1)[0]) == 0, f"$ {command.text}\n{segment[0][-2000:]}"
        assert matches(command.expected, segment[0].splitlines()), (command.text, command.expected, segment[0])


def helm_values(words: list[str], start_at: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The values (`--set`, `-f`) and other flags of a helm command line from `start_at` on."""
    values: dict[str, Any] = {}
    flags: dict[str, str] = {}
    rest = iter(words[start_at:])
    for word in rest:
        if word == "--set":
            merge(values, helm_python.parse_set_string(next(rest)))
        elif word in ("-f", "--values"):
            merge(values, yaml.safe_load((ROOT / next(rest)).read_text()))
        elif word in ("--namespace", "-n"):
            flags["namespace"] = next(rest)
        elif word.startswith("--"):
            flags[word] = "true"
        else:
            raise AssertionError(f"helm argument this test does not know: {word!r} in {words}")
    return values, flags


def merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def test_helm_blocks_carried_out_with_helms_engine() -> None:
    done = set()
    for block in of("helm"):
        for words in command_words(block):
            assert words[0] == "helm", words
            if words[1] == "lint":
                _, flags = helm_values(words, 3)
                report = helm_python.lint(ROOT / words[2], strict="--strict" in flags)
                assert not report["errors"] and all(m["severity"] <= 1 for m in report["messages"]), report
            elif words[1] == "template":
                values, flags = helm_values(words, 4)
                docs = render(values, name=words[2], namespace=flags.get("namespace", "default"),
                              chart=ROOT / words[3])
                for doc in docs:
                    validate(doc)
                assert {"HorizontalPodAutoscaler", "ServiceMonitor"} <= {d["kind"] for d in docs}
            else:
                raise AssertionError(f"not a step a test can carry out offline: {words}")
            done.add(words[1])
    assert done == {"lint", "template"}


def test_cluster_steps_use_values_the_chart_accepts() -> None:
    """`helm install` / `helm upgrade --reuse-values` of the local chart, in page order, rendered and validated."""
    releases: dict[str, dict[str, Any]] = {}
    rendered = 0
    for block in of("cluster-only") + of("docker-only"):
        for words in command_words(block):
            if words[:2] in (["helm", "install"], ["helm", "upgrade"]):
                chart = ROOT / words[3]
                values, flags = helm_values(words, 4)
                if not chart.is_dir():  # a chart of a repository (the adapter): its values file must exist
                    continue
                if words[1] == "upgrade":
                    assert "--reuse-values" in flags and words[2] in releases, words
                    merge(releases[words[2]], values)
                else:
                    releases[words[2]] = values
                for doc in render(releases[words[2]], name=words[2], namespace=flags["namespace"], chart=chart):
                    validate(doc)
                rendered += 1
            elif words[:3] == ["python", "-m", "service.ray"]:
                parse(words[3:])
    assert rendered >= 3


def ray_argv(words: list[str]) -> list[str] | None:
    if words[:3] == ["python", "-m", "service.ray"]:
        return words[3:]
    if words[:3] == ["serve", "run", "service.ray:build"]:
        return argv_from_mapping(dict(w.split("=", 1) for w in words[3:]))
    return None


def test_ray_commands_parse_with_the_entry_points_parser() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    parsed = 0
    for block in of("ray"):
        for words in command_words(block):
            argv = ray_argv(words)
            if argv is not None:
                parse(argv)  # exits 2 on an unknown option or a bad value
                parsed += 1
            elif words[:3] == ["pip", "install", "-e"]:
                wanted = re.fullmatch(r"\.\[(.+)\]", words[3])
                assert wanted and set(wanted.group(1).split(",")) <= set(extras), words
            else:
                raise AssertionError(f"a command this test does not check: {words}")
    assert parsed >= 3


def test_promql_on_the_page_matches_the_servers_metrics(exposition: Exposition) -> None:
    queries = [line for b in BLOCKS if b.lang == "promql" for line in b.body if line.strip()]
    assert len(queries) >= 5
    for query in queries:
        assert not check_query(query, exposition), (query, check_query(query, exposition))


def yaml_blocks() -> list[Any]:
    return [yaml.safe_load("\n".join(b.body)) for b in BLOCKS if b.lang == "yaml"]


def test_adapter_rule_on_the_page_is_the_shipped_one() -> None:
    shipped = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    shown = [doc for doc in yaml_blocks() if isinstance(doc, list) and doc and "seriesQuery" in doc[0]]
    assert shown == [shipped]


def test_ray_configs_on_the_page_parse() -> None:
    configs = []
    for doc in yaml_blocks():
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
        if isinstance(doc, dict) and "applications" in doc:
            configs += doc["applications"]
    assert len(configs) == 2
    for app in configs:
        assert app["import_path"] == "service.ray:build"
        parse(argv_from_mapping(app["args"]))


def test_inference_service_on_the_page_names_the_charts_runtime() -> None:
    (isvc,) = [d for d in yaml_blocks() if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    (runtime,) = [d for d in render({"kserve": {"servingRuntime": {"enabled": True}}}, name="mm",
                                    namespace=isvc["metadata"]["namespace"]) if d["kind"] == "ServingRuntime"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]


def test_the_page_has_no_placeholder_registry() -> None:
    assert "registry.example.com" not in DOC.read_text()
    assert Path(DOC).read_text().count("multimax-serve:0.1.0") >= 2
