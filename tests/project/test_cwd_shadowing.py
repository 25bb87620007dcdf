"""Every documented command works from a working directory that holds `models/`, `export/`, `service/` and
`plugins/` folders of user files (the natural place for model files), under the README's editable install
(`pip install -e .`) and under an installed wheel.

Such a folder has no __init__.py: a namespace package. Python's path search prefers a regular package found
anywhere on sys.path to namespace portions, so an installed wheel (packages in site-packages) was never
shadowed; setuptools' editable hook for this flat layout is an import finder asked only after that search,
so the working directory's `models/` won and `python -m service` failed (`models.__file__` is None). setup.py's
editable install now puts the checkout on sys.path too.

Each install is a fresh virtual environment (the project installed with --no-deps, its dependencies from this
interpreter's site-packages through a .pth line, as in tests/project/test_wheel.py), so setup.py as it is now is what is
tested; the environment running the tests is checked too, where its editable install is this setup.py's.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.paths import ROOT

COMMANDS = ("service", "export", "models", "plugins.ort_ops", "service.ray")
CHECKOUT_PTH = "__editable__.multimax_serve-*.checkout.pth"  # what setup.py's editable install adds


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory as a user has it: folders named like the project's packages, holding files."""
    where = tmp_path_factory.mktemp("workdir")
    files = {"models/my_model.onnx": "not really onnx", "models/labels.txt": "cat\ndog\n",
             "models/llama/config.json": "{}", "export/notes.txt": "exports go here",
             "service/settings.env": "PORT=8000", "plugins/readme.md": "# my plugins"}
    for name, text in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)
    return where


def _fresh_venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    platlib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies' paths only: this interpreter's editable-install hook is not run there
    (Path(platlib) / "shared_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _pip_install(python: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def editable_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install -e .` of this checkout, as the README installs it (no build isolation: no registry)."""
    python = _fresh_venv(tmp_path_factory.mktemp("editable") / "venv")
    _pip_install(python, "--no-build-isolation", "-e", str(ROOT))
    return python


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installed wheel (pure: the fused library is not what this tests, and building it takes a while)."""
    dist = tmp_path_factory.mktemp("dist")
    env = os.environ | {"MULTIMAX_BUILD_ORT_OPS": "0"}
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = dist.glob("*.whl")
    python = _fresh_venv(tmp_path_factory.mktemp("wheel") / "venv")
    _pip_install(python, "--no-index", str(wheel))
    return python


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install alone decides


def check_commands_from(python: Path, cwd: Path) -> None:
    failed = []
    for command in COMMANDS:
        done = subprocess.run([str(python), "-m", command, "--help"], cwd=cwd, capture_output=True, text=True,
                              timeout=300, env=_env())
        if done.returncode != 0 or not done.stdout.startswith(f"usage: python -m {command} "):
            failed.append(f"python -m {command} --help: exit {done.returncode}\n{done.stderr[-2000:]}")
    where = subprocess.run([str(python), "-c", "import models, plugins, export, service; "
                            "print(*(m.__file__ for m in (models, plugins, export, service)))"],
                           cwd=cwd, capture_output=True, text=True, timeout=120, env=_env())
    assert where.returncode == 0, where.stderr
    assert not failed, "\n\n".join(failed)
    files = [Path(f) for f in where.stdout.split()]
    assert len(files) == 4 and all(f.name == "__init__.py" and cwd not in f.parents for f in files), where.stdout


def test_an_editable_install_is_not_shadowed_by_user_folders(editable_python: Path, user_dir: Path) -> None:
    check_commands_from(editable_python, user_dir)


def test_an_installed_wheel_is_not_shadowed_by_user_folders(wheel_python: Path, user_dir: Path) -> None:
    check_commands_from(wheel_python, user_dir)


def test_this_environment_is_not_shadowed_by_user_folders(user_dir: Path) -> None:
    """The interpreter running the tests (CI's fresh `pip install -e ".[dev]"`)."""
    purelib = Path(sysconfig.get_path("purelib"))
    editable = list(purelib.glob("__editable__*multimax_serve*.pth"))
    if editable and not list(purelib.glob(CHECKOUT_PTH)):
        pytest.skip(f"this environment's editable install ({purelib}) predates setup.py's checkout .pth: "
                    "run `pip install -e .` again (the fresh installs above test setup.py as it is)")
    check_commands_from(Path(sys.executable), user_dir)
