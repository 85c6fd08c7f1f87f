"""The one place pallas_kernels knows about JAX version differences (CPU 0.10.x, GPU 0.11.x).

pallas_kernels sits below meshlab (meshlab/compat.py cannot be imported here), so its own few
differences live in this module.
"""
from jax.experimental.pallas import triton as plgpu

# The Triton backend's compiler-params class was renamed (TritonCompilerParams -> CompilerParams).
TritonCompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
