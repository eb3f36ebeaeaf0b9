"""Layer 5, tools: ``python -m parallel_state`` (``cli``), the plan report (``plan_report``),
the layout picture (``layout_svg``) and the demo launcher (``demo``). Nothing imports them but
``parallel_state.__main__``.
"""
