"""The tiny served model and the small-page-pool engine that the engine test files share: built once per
process, whichever file asks first, so the engine's programs compile once for all of them."""
import contextlib
import functools
import os

from meshlab.infer.engine import Engine
from tests.helpers import cheap_codegen, tiny_served_model


def _codegen():
    """A `cheap_codegen` module's code generation (tests/conftest.py) for what is built here: the session
    fixtures that call these are set up before the module fixture that enters it."""
    return contextlib.nullcontext() if os.environ.get("MESHLAB_TEST_GPU") else cheap_codegen()


@functools.cache
def tiny_model():
    """tests.helpers.tiny_served_model(): (model def, params, jitted full forward)."""
    with _codegen():
        return tiny_served_model()


@functools.cache
def small_pool_engine():
    """13 usable pages of 4 tokens for 4 rows of up to 64 tokens: forces queueing and preemption."""
    md, params, _ = tiny_model()
    with _codegen():
        return Engine(md, params, max_len=64, max_seqs=4, page_size=4, num_pages=14, chunk=8, steps_per_call=4)
