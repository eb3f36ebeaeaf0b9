"""The project's shape: a wheel installs exactly the three packages, with every layer subpackage."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("topology", "groups", "megatron", "runtime", "tools")


def test_wheel_installs_only_parallel_state_cp_and_scheduler(tmp_path):
    # A copy of the sources, examples included, so the build leaves nothing in the checkout and
    # the examples' absence from the wheel is a choice of the packaging, not of what was copied.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("parallel_state", "cp", "scheduler", "examples"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"parallel_state", "cp", "scheduler"}, top
    for layer in LAYERS:
        assert f"parallel_state/{layer}/__init__.py" in names, layer
    assert not [n for n in names if "demo_dit" in n or "parallel_state_demo" in n]
