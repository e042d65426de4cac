"""Separable networks over G devices with a learned communication controller (paper 004).

``network`` (the group-separable ResNeXt), ``decisions`` (permutations and sparsity levels), ``cost`` (bytes,
staleness-aware latency on a cluster topology), ``controller`` (LSTM REINFORCE and the random sampler), ``search``
(the alternating run behind ``jmsnas separable``).
"""
