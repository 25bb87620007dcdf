"""Every command in README.md's console blocks runs as written from the root of a fresh copy of the repository,
after the set-up command, and prints what the README shows.

The blocks are read from README.md itself, so the README and this test cannot drift apart. Each block runs in
its own temporary copy of the working tree (a git repository of its own): afterwards `git status` must be
clean, i.e. every file a command wrote is ignored and no tracked file changed.

What is not re-run here, and why: the set-up (`python3 -m venv .venv && .venv/bin/pip install ...`) is stood
in for by a `.venv/bin` whose `python`, `pip` and `ruff` are this interpreter's (CI runs the real set-up
command verbatim in `.ci/run`), and `python -m pytest` is the command running this test. A block that
starts the server (`python -m service`) gets it on a free port, and its `localhost:8000` is rewritten to match.
A block preceded by `<!-- readme-test: slow -->` is marked slow; one preceded by
`<!-- readme-test: not run: REASON -->` is reported as skipped with REASON, which must name the test that runs
its commands instead (Ray binds to the machine's interface, so its commands run only inside a loopback-only
network namespace, in tests/service/ray/test_ray_serve.py).

Output matching: each line the README shows must appear, in order, among the lines the command printed.
Durations (`7.3 s`, `7.39 ms/image`), numbers in scientific notation or with six or more decimals
(floating-point differences and full-precision probabilities, which depend on the CPU) and the export's
thread count (chosen from the load) match any number, the fused ops' kernel paths (chosen by the CPU) any
paths, and their library's source hash any hash; everything else must match exactly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.server import free_port, stop, wait_ready
from tests.paths import ROOT

README = ROOT / "README.md"
SLOW_MARK = "<!-- readme-test: slow -->"
NOT_RUN_MARK = re.compile(r"<!-- readme-test: not run: (?P<reason>.+) -->")
STARTS_RAY = re.compile(r"\bpython -m service\.ray\b(?!.*--help)|\bserve run\b|\bray start\b")
SETUP_PARTS = (re.compile(r"python3 -m venv \.venv$"), re.compile(r"\.venv/bin/pip install .*"))
SELF = re.compile(r"(\.venv/bin/)?python -m pytest\b.*")  # the command running this test
SERVER = re.compile(r"python -m service( &)?(\s+#.*)?$")
# Durations, floating-point differences (CPU-dependent) and the thread count chosen from the machine's load.
VOLATILE = re.compile(
    r"\d+(\.\d+)?(?= ?(s|ms|ms/image|min)\b)|\d\.\d+e[+-]\d+|\d\.\d{6,}|(?<=PyTorch threads )\d+"
    r"|(?P<isa>((?<=onnxruntime, )|(?<=default: ))(portable|avx2|avx512))"  # the kernel path the CPU chose
    r"|(?P<paths>(?<=on this CPU: )[a-z0-9, ]+(?= \(default))"  # ... and the paths this CPU runs
    r"|(?P<hash>(?<=libmultimax_ort_ops\.api\d\d\.)[0-9a-f]{16}(?=\.so))"  # the library's source hash
)
# What a volatile part of a line matches, by its group in VOLATILE (numbers otherwise).
VOLATILE_MATCH = {"isa": "(portable|avx2|avx512)", "paths": "[a-z0-9, ]+", "hash": "[0-9a-f]{16}"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int
    slow: bool
    commands: list[Command]
    not_run: str | None = None  # why this block runs elsewhere

    @property
    def id(self) -> str:
        return f"L{self.line}:{self.commands[0].text.split('#')[0].strip()[:50]}"


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        slow = i > 0 and lines[i - 1].strip() == SLOW_MARK
        not_run = NOT_RUN_MARK.fullmatch(lines[i - 1].strip()) if i > 0 else None
        start, commands = i + 1, []
        i += 1
        while lines[i].strip() != "```":
            line = lines[i]
            if line.startswith("$ "):
                cmd = line[2:]
                while cmd.endswith("\\"):
                    i += 1
                    cmd = cmd[:-1] + lines[i].strip()
                commands.append(Command(cmd))
            elif commands and line.strip():  # blank lines only separate commands
                commands[-1].expected.append(line)
            i += 1
        blocks.append(Block(start, slow, commands, not_run["reason"] if not_run else None))
        i += 1
    return blocks


def runnable(cmd: str) -> str | None:
    """The command as this test runs it: set-up parts dropped (stood in for), None if nothing is left to run."""
    parts = [p.strip() for p in cmd.split(" && ")]
    parts = [p for p in parts if not any(r.match(p) for r in SETUP_PARTS)]
    if not parts or any(SELF.match(p) for p in parts):
        return None
    return " && ".join(parts)


def fresh_copy(tmp: Path) -> Path:
    """The working tree's tracked and unignored files in a new git repository, plus a stand-in `.venv/bin`."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    repo = tmp / "repo"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "snapshot"], cwd=repo, check=True)
    bindir = repo / ".venv" / "bin"
    bindir.mkdir(parents=True)
    here = Path(sys.executable).parent
    for tool, target in (("python", sys.executable), ("pip", here / "pip"), ("ruff", here / "ruff")):
        (bindir / tool).write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        (bindir / tool).chmod(0o755)
    return repo


def script(commands: list[str]) -> str:
    """One bash script, so `echo $?` sees the previous command's status; markers split the output per command."""
    out = ["set +e", "__rc=0"]
    for i, cmd in enumerate(commands):
        out.append(f"printf '\\n@@CMD {i}\\n'; (exit $__rc); {{ {cmd}\n}} 2>&1; __rc=$?; printf '\\n@@RC %d\\n' $__rc")
    return "\n".join(out) + "\n"


def line_pattern(want: str) -> re.Pattern[str]:
    parts, last = [], 0
    for m in VOLATILE.finditer(want):
        kind = next((k for k in VOLATILE_MATCH if m[k]), None)
        parts += [re.escape(want[last : m.start()]), VOLATILE_MATCH[kind] if kind else r"[\d.e+-]+"]
        last = m.end()
    return re.compile("".join([*parts, re.escape(want[last:])]))


def matches(expected: list[str], actual: list[str]) -> bool:
    """Every expected line, in order, among the actual ones (volatile numbers match any number)."""
    pos = 0
    for want in expected:
        pattern = line_pattern(want.rstrip())
        while pos < len(actual) and not pattern.fullmatch(actual[pos].rstrip()):
            pos += 1
        if pos == len(actual):
            return False
        pos += 1
    return True


BLOCKS = readme_blocks(README.read_text())


def test_the_readme_has_console_blocks_and_the_parser_reads_them() -> None:
    assert len(BLOCKS) >= 6
    assert any(runnable(c.text) == ".venv/bin/python -m models.training demo" for b in BLOCKS for c in b.commands)
    assert matches(["wrote a.onnx in 7.3 s (x)", "max|diff| 9.54e-07  top-1 100%"],
                   ["noise", "wrote a.onnx in 12.0 s (x)", "max|diff| 1.2e-06  top-1 100%"])
    assert not matches(["top-1 100%"], ["top-1 99%"])
    assert matches(["ops (onnxruntime, avx2): max|diff| 1.07e-06"], ["ops (onnxruntime, portable): max|diff| 2.1e-06"])
    # Ray must never start here outside a loopback-only namespace: every block that would start it says where
    # it runs instead.
    for block in BLOCKS:
        if any(STARTS_RAY.search(c.text) for c in block.commands):
            assert block.not_run and "tests/service/ray/test_ray_serve.py" in block.not_run, \
                f"{block.id} would start Ray"


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, id=b.id, marks=([pytest.mark.slow] if b.slow else [])
                     + ([pytest.mark.skip(reason=b.not_run)] if b.not_run else []))
        for b in BLOCKS
    ],
)
@pytest.mark.timeout(900)
def test_readme_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    repo = fresh_copy(tmp_path)
    env = {**os.environ, "PATH": f"{repo / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": "", "COLUMNS": "120"}
    commands = [c for c in block.commands if runnable(c.text) is not None]
    if not commands:
        pytest.skip("only set-up and the test command itself: .ci/run runs them verbatim")
    server = None
    if any(SERVER.match(c.text) for c in commands):
        port = free_port()
        env["MULTIMAX_SERVE_PORT"] = str(port)
        server = subprocess.Popen([sys.executable, "-m", "service"], cwd=repo, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_ready(f"http://127.0.0.1:{port}", server)
        commands = [c for c in commands if not SERVER.match(c.text)]
    try:
        texts = [runnable(c.text) or "" for c in commands]
        if server is not None:
            texts = [t.replace("localhost:8000", f"localhost:{env['MULTIMAX_SERVE_PORT']}") for t in texts]
        proc = subprocess.run(["bash", "-c", script(texts)], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=840)
    finally:
        if server is not None:
            stop(server)
    output = ANSI.sub("", proc.stdout.replace("\r", "\n"))
    for i, command in enumerate(commands):
        segment = output.split(f"@@CMD {i}\n", 1)[1].split("\n@@RC ", 1)
        lines, rc = segment[0].splitlines(), int(segment[1].split("\n", 1)[0])
        shown_failing = any(line.startswith("error:") for line in command.expected)
        assert "Traceback" not in segment[0], f"$ {command.text}\n{segment[0][-3000:]}"
        assert rc == (2 if shown_failing else 0), f"$ {command.text} exited {rc}\n{segment[0][-3000:]}"
        assert matches(command.expected, lines), (
            f"$ {command.text}\nREADME shows:\n" + "\n".join(command.expected) + "\ngot:\n" + "\n".join(lines[-60:])
        )
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert status == "", f"files the commands wrote that git would pick up, or tracked files changed:\n{status}"
