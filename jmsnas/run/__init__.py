"""The run layer under every flow (``search``/``retrain``, ``evolve``, SplitNets, separable networks).

* ``directory``: the run directory, read and written in one place (result.json, config.json, parts/, ...).
* ``workdir``: checking and claiming a workdir, and the run's fingerprint.
* ``loop``: the epoch loop with mid-epoch and epoch-end checkpoints and exact resume, the progress bar, and the
  generation loop's checkpoints.

Flows build on these; nothing here imports a flow. The submodules are imported by name (``from jmsnas.run import
directory``), so importing one does not import the others.
"""
