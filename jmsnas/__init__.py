"""jmsnas: joint model split and neural architecture search over networks of devices, in JAX."""
