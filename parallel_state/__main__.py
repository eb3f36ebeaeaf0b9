"""``python -m parallel_state``: the command line (see ``parallel_state.cli``)."""

from parallel_state.cli import main

raise SystemExit(main())
