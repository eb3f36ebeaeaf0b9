"""Where the oracle environments live and how they are built: one Python 3.12 venv, one folder per release.

The venv (``base``) holds torch as the package index gives it on 3.12 and the project's dependencies and test
extra, megatron-core aside (read from pyproject.toml). Each release is ``pip install --no-deps --target
megatron-core-X.Y.Z``, put first on ``PYTHONPATH``, so the four releases share one torch. megatron-core's own
test file of each release is kept beside it, read from a Megatron-LM git checkout or downloaded from GitHub.
Every step is skipped when its result is already there, so a second build does nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request

import tomllib

from . import RELEASES, TEST_FILE_TAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_VERSION = (3, 12)
TEST_FILE = "tests/unit_tests/test_parallel_state.py"
RAW = "https://raw.githubusercontent.com/NVIDIA/Megatron-LM/{tag}/" + TEST_FILE


def root() -> str:
    """``$PARALLEL_STATE_ORACLES``, else ``.oracles`` in the checkout (git ignores it)."""
    return os.path.abspath(os.environ.get("PARALLEL_STATE_ORACLES") or os.path.join(REPO, ".oracles"))


def python() -> str:
    """The base environment's interpreter."""
    return os.path.join(root(), "base", "bin", "python")


def release_dir(name: str) -> str:
    return os.path.join(root(), f"megatron-core-{RELEASES[name]}")


def test_file(name: str) -> str:
    """megatron-core's own test file of release ``name`` (its Megatron-LM tag's copy)."""
    return os.path.join(root(), "megatron-lm", TEST_FILE_TAGS[name], TEST_FILE)


def env(name: str) -> dict[str, str]:
    """The environment a process needs to see release ``name`` first, then this checkout."""
    path = [release_dir(name), REPO, os.path.join(REPO, "tests")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONNOUSERSITE": "1"}


def missing(name: str) -> str | None:
    """Why release ``name`` cannot run (None when its environment is complete)."""
    if not os.path.exists(python()):
        return f"no oracle environment at {root()}: run `python -m tests.oracles build`"
    if not os.path.isdir(os.path.join(release_dir(name), f"megatron_core-{RELEASES[name]}.dist-info")):
        return f"megatron-core {RELEASES[name]} is not built in {root()}: run `python -m tests.oracles build {name}`"
    return None


def _say(message: str) -> None:
    print(f"[oracles] {message}", flush=True)


def _run(cmd: list[str]) -> None:
    _say("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def _find_python(explicit: str | None) -> str:
    candidates = [explicit] if explicit else [os.environ.get("PARALLEL_STATE_ORACLES_PYTHON"), "python3.12",
                                              os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12")]
    for candidate in filter(None, candidates):
        found = shutil.which(candidate) or (candidate if os.path.exists(candidate) else None)
        if not found:
            continue
        probe = subprocess.run([found, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                               text=True, env={**os.environ, "PYENV_VERSION": os.environ.get("PYENV_VERSION", "3.12.1")})
        if probe.returncode == 0 and tuple(map(int, probe.stdout.split())) == PYTHON_VERSION:
            return found
    raise SystemExit(f"no Python {'.'.join(map(str, PYTHON_VERSION))} found (tried {', '.join(filter(None, candidates))}): "
                     "pass --python PATH or set PARALLEL_STATE_ORACLES_PYTHON")


def requirements() -> list[str]:
    """The project's dependencies and test extra, megatron-core aside (each release brings its own)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    return [r for r in wanted if not re.match(r"megatron[-_]core\b", r)]


def _base(interpreter: str | None) -> None:
    if os.path.exists(python()):
        _say(f"base environment {os.path.dirname(os.path.dirname(python()))} exists")
    else:
        found = _find_python(interpreter)
        _say(f"creating the base environment with {found} (torch from the index: a few GB, minutes)")
        _run([found, "-m", "venv", os.path.dirname(os.path.dirname(python()))])
    check = subprocess.run([python(), "-c", "import torch, pytest, einops, loguru"], capture_output=True)
    if check.returncode != 0:
        _run([python(), "-m", "pip", "install", "--upgrade", "pip"])
        _run([python(), "-m", "pip", "install", *requirements()])


def _release(name: str) -> None:
    if missing(name) is None:
        _say(f"megatron-core {RELEASES[name]} is in {release_dir(name)}")
        return
    shutil.rmtree(release_dir(name), ignore_errors=True)  # a half-made folder from an interrupted build
    _run([python(), "-m", "pip", "install", "--no-deps", "--target", release_dir(name),
          f"megatron-core=={RELEASES[name]}"])
    # Its own requirements go to the shared venv (pip leaves those already met alone).
    metadata = os.path.join(release_dir(name), f"megatron_core-{RELEASES[name]}.dist-info", "METADATA")
    with open(metadata, encoding="utf-8") as f:
        needs = [line.split(":", 1)[1].strip() for line in f
                 if line.startswith("Requires-Dist:") and "extra ==" not in line]
    if needs:
        _run([python(), "-m", "pip", "install", *needs])


def _test_file(name: str, megatron_lm: str | None) -> None:
    path, tag = test_file(name), TEST_FILE_TAGS[name]
    if os.path.exists(path):
        _say(f"{tag}'s {TEST_FILE} is at {path}")
        return
    if megatron_lm:
        text = subprocess.run(["git", "-C", megatron_lm, "show", f"{tag}:{TEST_FILE}"], check=True,
                              capture_output=True, text=True).stdout
        source = f"{megatron_lm} at {tag}"
    else:
        try:
            with urllib.request.urlopen(RAW.format(tag=tag), timeout=30) as response:
                text = response.read().decode()
        except OSError as exc:
            _say(f"cannot download {RAW.format(tag=tag)} ({exc}); megatron-core's own test file of {name} will not "
                 "run: pass --megatron-lm PATH (a Megatron-LM git clone) or set MEGATRON_LM")
            return
        source = RAW.format(tag=tag)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    _say(f"{TEST_FILE} of {tag} from {source} -> {path}")


def build(names: list[str], interpreter: str | None = None, megatron_lm: str | None = None) -> None:
    """Make (or complete) the base environment, each release's folder and its test file."""
    _say(f"oracle environments in {root()}")
    os.makedirs(root(), exist_ok=True)
    _base(interpreter)
    for name in names:
        _release(name)
        _test_file(name, megatron_lm or os.environ.get("MEGATRON_LM"))
    _say(f"done: {sys.executable} -m tests.oracles snapshot / test RELEASE")
