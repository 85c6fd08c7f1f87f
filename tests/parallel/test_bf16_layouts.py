"""Rule files that gather weights, and the expert dispatch, train in bf16 on XLA's CPU backend like one device.

There a bf16 reduce-scatter or psum (an FSDP gather's transpose, the experts' width sum, shard_map's sum of a
replicated input's cotangent) aborted XLA ("Invalid binary instruction opcode copy"); meshlab.compat runs
those collectives in fp32 on the CPU. bf16 keeps 8 bits of mantissa, and the layouts sum in other orders:
the losses agree within 2e-3 (measured: 4.5e-4), not fp32's 1e-5."""
import numpy as np
import pytest

from meshlab.train.loop import train
from tests.helpers import one_device, small_config

pytestmark = pytest.mark.cheap_codegen
BF16_LOSS_RTOL = 2e-3


@pytest.mark.parametrize("rules,mesh,model", [("fsdp_tp", None, "llama"), ("pp_fsdp_tp", "stage=2,fsdp=2,tensor=2", "llama"),
                                              ("fsdp_tp_ep", "fsdp=2,tensor=2,expert=2", "moe_tiny")])
def test_bf16_trains_like_one_device(rules, mesh, model):
    extra = ["model.dtype=bfloat16"] + ([f"model.name={model}"] if model != "llama" else [])
    run = extra + (["data.microbatches=2"] if rules.startswith("pp_") else [])
    ref = train(small_config("dp", mesh="data=1", extra=extra), devices=one_device(), progress=False, write=False)
    out = train(small_config(rules, mesh=mesh, extra=run), progress=False, write=False)
    assert out["trainer"].mesh.devices.size == 8
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=BF16_LOSS_RTOL)
