"""The run layer under every flow (``search``/``retrain``, ``evolve``, SplitNets, separable networks, FBNet).

* ``directory``: the run directory, read and written in one place (result.json, config.json, parts/, ...).
* ``workdir``: checking and claiming a workdir, and the run's fingerprint.
* ``loop``: the epoch loop with mid-epoch and epoch-end checkpoints and exact resume, the progress bar, and the
  generation loop's checkpoints.
* ``supernet``: the sandwich-rule supernet step and its epoch loop (stage 1 of ``evolve`` and SplitNets).
* ``evolution``: the evolution loop (ask/tell over generations, best and most accurate kept) on that loop, and
  ``search``: stage 1 then the evolution over a ``Problem``, what a flow's space differs in.
* ``processes``: a population shared out among the processes of a multi-process run.

Flows build on these; nothing here imports a flow. The submodules are imported by name (``from jmsnas.run import
directory``), so importing one does not import the others.
"""
