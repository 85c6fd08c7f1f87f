"""Test set-up: 8 simulated CPU devices, fixed before JAX initialises its backend."""
import os

# On the GPU machine run `MESHLAB_TEST_GPU=1 pytest -m gpu`; everywhere else tests see the CPU.
if not os.environ.get("MESHLAB_TEST_GPU"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
elif os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist workers share the card: each would take 75% of its memory at start and the second fails
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags and not os.environ.get("MESHLAB_TEST_GPU"):
    # 5x faster CPU compiles (meshlab.compat); never applied to GPU code generation
    _flags += " --xla_backend_optimization_level=1"


def _jaxlib_before(major: int, minor: int) -> bool:
    from importlib.metadata import version
    return tuple(int(x) for x in version("jaxlib").split(".")[:2]) < (major, minor)


if ("xla_cpu_use_fusion_emitters" not in _flags and not os.environ.get("MESHLAB_TEST_GPU")
        and _jaxlib_before(0, 11)):
    # XLA's elemental fusion code generation in place of its MLIR fusion emitters: the same collectives and
    # buffer sizes within bytes (the memory and HLO tests pass unchanged), 3-4x less CPU per compile of a
    # small sharded step (fsdp_tp: 7.5 -> 2.1 s, its init 2.9 -> 1.5 s); the suite is compile-bound.
    # CPU only: GPU code generation never sees it. Subprocesses the tests start inherit it. jaxlib 0.11
    # no longer has the flag, and XLA aborts on an unknown one (the CPU tests on the GPU machine's jax).
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One persistent compile cache per run, shared by the xdist workers (made by the first process that
# imports this file, inherited by the workers it starts, removed when that process exits): the suite
# compiles the same programs again and again from fresh jit objects (a new trainer or engine per test)
# and in both workers, and jax's in-memory caches key on the object, so each time was a full XLA
# compile. A hit loads the same executable (memory_analysis and as_text included). Subprocesses the
# tests start see none of it (their environment is as a user's), but for test_checkpoint.subprocess_env's.
# CPU only (GPU runs compile as usual); MESHLAB_TEST_COMPILE_CACHE=off compiles everything afresh.
_CACHE_ENV = "MESHLAB_TEST_COMPILE_CACHE"
if not os.environ.get("MESHLAB_TEST_GPU") and os.environ.get(_CACHE_ENV) != "off":
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="meshlab-test-compile-cache-")
        atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)   # below that a read saves little
    # a size limit turns on jax's file lock, so a worker never reads an entry the other is still writing
    jax.config.update("jax_compilation_cache_max_size", 16 << 30)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "cheap_codegen: the module's compiles use LLVM's cheapest code generation "
                                       "(tests.helpers.cheap_codegen); CPU only")


@pytest.fixture(autouse=True, scope="module")
def _cheap_codegen_for_marked_modules(request):
    """A module marked `cheap_codegen` compiles everything, its module fixtures included, cheaply."""
    if request.node.get_closest_marker("cheap_codegen") is None or os.environ.get("MESHLAB_TEST_GPU"):
        yield
        return
    from helpers import cheap_codegen
    with cheap_codegen():
        yield


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
