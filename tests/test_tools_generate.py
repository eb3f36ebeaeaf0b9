"""The checked-in source that follows the release table, the rules and the kind rows is what
``python -m parallel_state.tools.generate`` writes from them today."""

from __future__ import annotations

import os

import pytest

from parallel_state.tools import generate


def test_the_checked_in_source_is_what_its_tables_generate():
    stale = generate.generate(write=False)
    assert stale == [], f"stale generated regions {stale}: run python -m parallel_state.tools.generate"


def test_a_stale_region_is_found_and_rewritten():
    path = generate.REGIONS["accessors"].path
    with open(os.path.join(generate.ROOT, path), encoding="utf-8") as f:
        text = f.read()
    regions = {n: r for n, r in generate.REGIONS.items() if r.path == path}
    tampered = text.replace("        return _TP_GROUP\n", "        return _TP_CP_GROUP\n", 1)
    assert tampered != text
    assert generate._rewritten(tampered, path, regions) == (text, ["accessors"])
    with pytest.raises(ValueError, match="has no region \\['accessors'\\]: add its marker lines"):
        generate._rewritten(text.replace("# <generated: accessors>", "# generated: accessors"), path, regions)
