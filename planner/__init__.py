"""The deployment planner (``twinserve plan``): a search over twin runs for the configuration that
meets the SLOs at the least cost. ``space`` (what is searched, pruned by memory), ``slo`` (the
verdict of one run, decided early), ``search`` (each configuration's capacity by a bracketing
search), ``pareto`` (fronts and the dominance bound), ``prices``, ``spec`` (the plan's inputs),
``plan`` (the whole search), ``output`` and ``report`` (what it writes)."""
