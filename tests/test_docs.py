"""Every code block of README.md and docs/*.md runs, and every name the pages show exists.

The convention the pages follow: a ```python block runs in one process without
``torch.distributed`` (a page's blocks in order, sharing one namespace, in a fresh interpreter);
a block with ``<!-- run on N ranks -->`` right above its fence runs on every rank of an N-rank
gloo pool (``torch.distributed`` is up) and must leave no model-parallel state behind
(``<!-- run on N ranks with megatron-core -->``: a pool whose ranks imported megatron-core);
```bash and ```text blocks are not run.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
RANKS = re.compile(r"<!-- run on (\d+) ranks( with megatron-core)? -->\n$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\b(ps|parallel_state|cp|scheduler)\.([A-Za-z_]\w*)")


def _blocks() -> list[tuple[str, int, int | None, bool, str]]:
    """(page, line of the fence, ranks or None, whether on megatron-core ranks, source) of every python block."""
    out = []
    for page in PAGES:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                assert m.group(1) in ("bash", "text"), f"{page}: a ```{m.group(1)} block: fence it python, bash or text"
                continue
            ranks = RANKS.search(text, 0, m.start())
            marked = ranks is not None and ranks.end() == m.start()
            out.append((page, text.count("\n", 0, m.start()) + 1, int(ranks.group(1)) if marked else None,
                        marked and ranks.group(2) is not None, m.group(2)))
    return out


BLOCKS = _blocks()
RANK_BLOCKS = [b for b in BLOCKS if b[2] is not None]


def test_pages_have_blocks_of_both_kinds():
    assert len(BLOCKS) > len(RANK_BLOCKS) > 0
    assert {"README.md", "docs/cp.md", "docs/runtime.md"} <= {b[0] for b in RANK_BLOCKS}


def test_single_process_blocks_run(tmp_path):
    pages: dict[str, list[tuple[int, str]]] = {}
    for page, line, n, _, source in BLOCKS:
        if n is None:
            pages.setdefault(page, []).append((line, source))
    # One interpreter for all pages (one torch import), a fresh namespace per page.
    script = ("import sys\nimport torch.distributed as dist\n"
              f"for page, blocks in {pages!r}.items():\n"
              "    ns = {'__name__': '__main__'}\n"
              "    for line, source in blocks:\n"
              "        exec(compile(source, f'{page}:{line}', 'exec'), ns)\n"
              "    assert not dist.is_initialized(), page\n"
              "print('ran', sum(map(len, " + repr(pages) + ".values())))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"ran {sum(map(len, pages.values()))}"  # blocks may print before


def _run_block(source: str, name: str) -> bool:
    """Run one documented block on this rank; whether it left model-parallel state behind."""
    import parallel_state as ps

    exec(compile(source, name, "exec"), {"__name__": "__main__"})
    return ps.model_parallel_is_initialized()


@pytest.mark.parametrize("page,line,ranks,megatron,source", RANK_BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in RANK_BLOCKS])
def test_rank_block_runs_and_cleans_up(pools, page, line, ranks, megatron, source):
    left = pools(ranks, megatron=megatron).run(_run_block, source, f"{page}:{line}", timeout=120)
    assert left == [False] * ranks, f"{page}:{line} left the model-parallel groups initialized"


def _documented_names() -> set[tuple[str, str]]:
    names = set()
    for page in PAGES:
        for span in CODE_SPAN.findall(open(os.path.join(ROOT, page), encoding="utf-8").read()):
            names.update(DOTTED.findall(span))
    return names


def test_every_documented_dotted_name_exists():
    import parallel_state as ps

    names = _documented_names()
    assert ("ps", "find_split") in names or ("parallel_state", "find_split") in names
    ps.find_split((1, 1, 1, 2, 1), cp_size=1)  # cp_size_t exists from the first find_split on, as documented
    missing = []
    for package, name in sorted(names):
        module = importlib.import_module("parallel_state" if package == "ps" else package)
        if hasattr(module, name):
            continue
        try:  # a submodule the page names
            importlib.import_module(f"{module.__name__}.{name}")
        except ImportError:
            missing.append(f"{package}.{name}")
    ps.destroy_model_parallel()
    assert not missing, f"the docs name what does not exist: {missing}"
