"""Search strategies as stateless ask/tell transforms; ``STRATEGIES`` maps names to factories, ``make`` builds one."""
from jmsnas.strategies.base import STRATEGIES, Strategy, best, make, run, step_fn
from jmsnas.strategies import evolution, qlearning, reinforce  # noqa: F401  (registers the factories)

__all__ = ["STRATEGIES", "Strategy", "best", "make", "run", "step_fn", "evolution", "qlearning", "reinforce"]
