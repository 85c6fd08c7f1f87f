"""meshlab: parallelism strategies as rule files over one JAX model."""
from meshlab import xla_flags as _xla_flags

# XLA reads XLA_FLAGS when its first backend starts: set the GPU overlap flags at import, before that.
_xla_flags.apply()
