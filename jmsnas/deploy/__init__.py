"""Deployment: jax.export of the per-device parts and a multi-process pipeline over throttled TCP links."""
