"""``python -m tests.oracles build|snapshot|test`` (see ``tests/oracles/__init__.py``; ``--help`` for each)."""

from __future__ import annotations

import argparse
import json
import sys

from . import RELEASES, release_name


def _names(given: list[str]) -> list[str]:
    try:
        return [release_name(g) for g in given] or list(RELEASES)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.oracles", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="make the Python 3.12 environments (idempotent; the first run takes minutes)")
    build.add_argument("releases", nargs="*", help=f"default: all of {', '.join(RELEASES.values())}")
    build.add_argument("--python", help="a Python 3.12 interpreter (default: $PARALLEL_STATE_ORACLES_PYTHON, python3.12)")
    build.add_argument("--megatron-lm", help="a Megatron-LM git clone to read each release's own test file from "
                                             "(default: $MEGATRON_LM, else download from GitHub)")
    snap = sub.add_parser("snapshot", help="regenerate tests/data/megatron_releases.json from the built releases")
    snap.add_argument("releases", nargs="*", help="default: all")
    snap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the file would change")
    test = sub.add_parser("test", help="the differential tests and megatron-core's own test file against a release")
    test.add_argument("releases", nargs="*", help="default: all")
    test.add_argument("--only", choices=("ours", "theirs", "suite"), action="append",
                      help="run only megatron-core's test file on parallel_state (ours), on the release's own "
                           "module (theirs), or only the project's differential tests (suite); default: all three")
    describe = sub.add_parser("describe", help=argparse.SUPPRESS)  # what snapshot runs inside an environment
    describe.add_argument("release")
    describe.add_argument("out")
    args = parser.parse_args(argv)

    if args.command == "build":
        from . import environments

        environments.build(_names(args.releases), args.python, args.megatron_lm)
        return 0
    if args.command == "snapshot":
        from . import snapshot

        return 0 if snapshot.write(_names(args.releases), check=args.check) else 1
    if args.command == "describe":
        from . import snapshot

        data = snapshot.describe(release_name(args.release))
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(data, f)
        return 0
    from . import live

    return live.main(_names(args.releases), args.only or ["suite", "ours", "theirs"])


if __name__ == "__main__":
    sys.exit(main())
