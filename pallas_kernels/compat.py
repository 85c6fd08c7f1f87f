"""The one place pallas_kernels knows about JAX version differences (CPU 0.10.x, GPU 0.11.x).

pallas_kernels sits below meshlab (meshlab/compat.py cannot be imported here), so its own few
differences live in this module.
"""
import inspect

from jax.experimental.pallas import mosaic_gpu as mgpu
from jax.experimental.pallas import triton as plgpu

# The Triton backend's compiler-params class was renamed (TritonCompilerParams -> CompilerParams).
TritonCompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


# Mosaic GPU's load: jax 0.11 deprecates passing an index beside the ref; 0.10 requires one.
_LOAD_NEEDS_INDEX = inspect.signature(mgpu.load).parameters["idx"].default is inspect.Parameter.empty


def mgpu_load(ref, *, layout):
    """`plgpu.load` (Mosaic GPU) of a whole, already indexed ref into registers in `layout`."""
    return mgpu.load(ref, (), layout=layout) if _LOAD_NEEDS_INDEX else mgpu.load(ref, layout=layout)
