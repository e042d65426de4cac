"""jmsnas: joint model split and neural architecture search over networks of devices, in JAX."""
from jmsnas import hostmem as _hostmem

# before JAX creates its CPU client (see jmsnas/hostmem.py): by default CPU steps run on the calling thread and
# keep their blocks in its untrimmed heap; JMSNAS_KEEP_FREED_MEMORY=1 one heap for all threads, =0 neither
if _hostmem.requested():
    _hostmem.keep_freed_memory()
elif not _hostmem.forbidden():
    _hostmem.keep_step_memory()
