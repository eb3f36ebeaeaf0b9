"""Layer 5, tools: ``python -m parallel_state`` (``cli``), the plan report (``plan_report``),
the layout picture (``layout_svg``), the demo launcher (``demo``) and ``python -m
parallel_state.tools.generate``, which writes the checked-in source that follows the release table
(``generate``). Nothing imports them but ``parallel_state.__main__`` (and the tests).
"""
