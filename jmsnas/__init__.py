"""jmsnas: joint model split and neural architecture search over networks of devices, in JAX.

Importing jmsnas changes nothing in the calling process (no JAX option, no allocator setting). The ``jmsnas``
command applies its host-memory and dispatch settings before JAX starts; a program of your own gets the same fast
CPU steps by calling ``jmsnas.hostmem.apply()`` before its first JAX array (docs in jmsnas/hostmem.py).
"""
