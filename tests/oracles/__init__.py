"""Live oracles: real megatron-core releases in Python 3.12 environments, beside ``parallel_state``.

``python -m tests.oracles build`` makes the environments, ``... snapshot`` regenerates
``tests/data/megatron_releases.json`` from the installed releases, ``... test RELEASE`` runs the differential
tests and megatron-core's own test file against one release (docs/megatron-releases.md, "The live tier").
Not part of the default test run: the README's command stays on Python 3.11 and needs none of this.
"""

from __future__ import annotations

#: The releases the oracles install, by the data's release name: megatron-core's newest patch of each.
RELEASES = {"0.16": "0.16.1", "0.17": "0.17.1", "0.18": "0.18.2", "0.19": "0.19.2"}

#: The Megatron-LM tag whose tests/unit_tests/test_parallel_state.py is each release's own test file
#: (0.19.1 and 0.19.2 have no tag of their own; their release branch keeps 0.19.0's test file unchanged).
TEST_FILE_TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2", "0.19": "core_v0.19.0"}


def release_name(spelling: str) -> str:
    """``"0.19"`` for ``"0.19"`` or ``"0.19.2"``; ValueError naming the known releases otherwise."""
    name = ".".join(spelling.split(".")[:2])
    if name not in RELEASES or spelling not in (name, RELEASES[name]):
        known = ", ".join(f"{n} ({v})" for n, v in RELEASES.items())
        raise ValueError(f"no oracle for megatron-core {spelling!r}; known: {known} (tests/oracles/__init__.py)")
    return name
