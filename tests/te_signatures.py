"""Make tests/data/te_dot_product_attention_<release>.json: the signatures of Transformer Engine's DotProductAttention.

Transformer Engine cannot be installed here (it builds CUDA kernels), so its signatures are read from its source
with ``ast``: for ``__init__``, ``set_context_parallel_group`` and ``forward`` of the class, every parameter's
name, kind and default (as source text, the way ``repr`` writes the value), ``self`` left out.

    python tests/te_signatures.py GIT_DIR      # a clone of NVIDIA/TransformerEngine (bare is fine)
    python tests/te_signatures.py --file dot_product_attention.py

The release is ``cp.transformer_engine.TE_RELEASE``; test_cp_transformer_engine.py compares the class with the file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py"
METHODS = ("__init__", "set_context_parallel_group", "forward")


def signatures(source: str, cls_name: str = "DotProductAttention",
               methods: tuple[str, ...] = METHODS) -> dict[str, list[list[str | None]]]:
    """``{method: [[name, kind, default source or None], ...]}`` for ``methods`` of class ``cls_name`` (also
    megatron-core's TEDotProductAttention, for cp.megatron's tests)."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in methods:
            continue
        a = fn.args
        if a.vararg or a.kwarg or a.posonlyargs:
            raise ValueError(f"{fn.name}: *args, **kwargs or positional-only parameters; extend this script")
        positional = [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
        defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
        rows = [[p.arg, kind, None if d is None else ast.unparse(d)]
                for (p, kind), d in zip(positional, defaults, strict=True)]
        rows += [[p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)]
                 for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
        out[fn.name] = rows[1:]  # self
    missing = set(methods) - set(out)
    if missing:
        raise ValueError(f"{cls_name} has no {sorted(missing)} in this source")
    return {m: out[m] for m in methods}


def render(data: dict) -> str:
    """JSON with one parameter per line (readable diffs when a release changes a parameter)."""
    methods = ",\n".join(f'  {json.dumps(m)}: [\n' + ",\n".join(f"   {json.dumps(row)}" for row in rows) + "\n  ]"
                          for m, rows in data["methods"].items())
    return (f'{{\n "release": {json.dumps(data["release"])},\n "source": {json.dumps(data["source"])},\n'
            f' "methods": {{\n{methods}\n }}\n}}\n')


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.path.dirname(HERE))
    from cp.transformer_engine import TE_RELEASE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("git_dir", nargs="?", help="a clone of NVIDIA/TransformerEngine (read at tag TE_RELEASE)")
    parser.add_argument("--file", help="the source file itself instead")
    args = parser.parse_args(argv)
    if args.file:
        with open(args.file) as f:
            source = f.read()
    elif args.git_dir:
        source = subprocess.run(["git", "--git-dir", args.git_dir, "show", f"{TE_RELEASE}:{SOURCE}"], check=True,
                                capture_output=True, text=True).stdout
    else:
        parser.error("pass GIT_DIR or --file")
    path = os.path.join(HERE, "data", f"te_dot_product_attention_{TE_RELEASE}.json")
    with open(path, "w") as f:
        f.write(render({"release": TE_RELEASE, "source": SOURCE, "methods": signatures(source)}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
