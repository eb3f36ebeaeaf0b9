"""``python -m parallel_state``: the command line (see ``parallel_state.tools.cli``)."""

from parallel_state.tools.cli import main

raise SystemExit(main())
