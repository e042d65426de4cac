"""jmsnas: joint model split and neural architecture search over networks of devices, in JAX."""
from jmsnas import hostmem as _hostmem

# opt-in (JMSNAS_KEEP_FREED_MEMORY=1), before JAX creates its CPU client: see jmsnas/hostmem.py
if _hostmem.requested():
    _hostmem.keep_freed_memory()
