"""The composed search (DESIGN.md "Composition: one search, each paper a special case").

One search space, a product of independent choices, each with its own gate: the op of every layer (JMSNAS), the
split (fixed or searched), the split module at every cut (SplitNets) and the bit widths of every layer's weights
and every cut's transmitted tensor (Auto-Split). Every cost is a sum or a max over terms that each depend on a few
choices, so its expectation under independent gates is closed form:

* ``choices``: what may be chosen (``Choices``), the probabilities of every gate (``ChoiceProbs``), one discrete
  configuration (``Config``);
* ``terms``: the per-choice cost terms of a space (``Terms``: ms, bytes), built once;
* ``cost``: E[T] (eq. (1) chain, eq. (2) mesh), E[memory] and E[energy] per device, the split fixed or searched;
* ``repair``: the most probable configuration within T_const and every device's memory and energy limit, exact
  (``frontier``: its Pareto frontiers; ``anysplit``: the same over every split);
* ``objective``: an architecture step's E[T] and limits hinge from every group of logits.

With every mechanism off (no module, float weights and transmitted tensors) each function returns what
``jmsnas.cost.latency``/``memory``/``energy`` return today.
"""
