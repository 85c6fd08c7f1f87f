"""hlo_traffic: bytes written per token by large copies in a compiled decode program (bench_decode)."""
from meshlab.bench.decode import hlo_traffic

# A decode loop of 4 tokens around a layer loop of 2 layers, shaped like XLA's own text: the layer
# body copies a dynamic slice of a stacked weight [2, 512, 1024] f32 (2 MiB per layer) before its
# dot and updates the cache in place.
HLO = """HloModule jit_decode_loop, is_scheduled=true

%fused_slice (param_0: f32[2,512,1024], param_1: s32[]) -> f32[512,1024] {
  %param_0 = f32[2,512,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic_slice.1 = f32[1,512,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,512,1024}
  ROOT %bitcast.1 = f32[512,1024]{1,0} bitcast(%dynamic_slice.1)
}

%fused_update (param_0: f32[2,64,1024], param_1: f32[1,1,1024], param_2: s32[]) -> f32[2,64,1024] {
  %param_0 = f32[2,64,1024]{2,1,0} parameter(0)
  %param_1 = f32[1,1,1024]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[2,64,1024]{2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c, %c)
}

%layer_body (arg: (s32[], f32[1,512], f32[2,512,1024], f32[2,64,1024])) -> (s32[], f32[1,512], f32[2,512,1024], f32[2,64,1024]) {
  %arg = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[1,512]{1,0} get-tuple-element(%arg), index=1
  %w = f32[2,512,1024]{2,1,0} get-tuple-element(%arg), index=2
  %cache = f32[2,64,1024]{2,1,0} get-tuple-element(%arg), index=3
  %slice_fusion = f32[512,1024]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %gemm = f32[1,1024]{1,0} custom-call(%x, %slice_fusion), custom_call_target="__cublas$gemm"
  %upd = f32[1,1,1024]{2,1,0} bitcast(%gemm)
  %update_fusion = f32[2,64,1024]{2,1,0} fusion(%cache, %upd, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) tuple(%i, %x, %w, %update_fusion)
}

%layer_cond (arg: (s32[], f32[1,512], f32[2,512,1024], f32[2,64,1024])) -> pred[] {
  %arg = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%token_body (arg: (s32[], f32[1,512], f32[2,512,1024], f32[2,64,1024])) -> (s32[], f32[1,512], f32[2,512,1024], f32[2,64,1024]) {
  %arg = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) parameter(0)
  ROOT %while.1 = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) while(%arg), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"2"}}
}

ENTRY %main (w: f32[2,512,1024], cache: f32[2,64,1024]) -> f32[2,64,1024] {
  %w = f32[2,512,1024]{2,1,0} parameter(0)
  %cache = f32[2,64,1024]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %x = f32[1,512]{1,0} constant({...})
  %init = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) tuple(%zero, %x, %w, %cache)
  %while.0 = (s32[], f32[1,512]{1,0}, f32[2,512,1024]{2,1,0}, f32[2,64,1024]{2,1,0}) while(%init), condition=%layer_cond, body=%token_body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[2,64,1024]{2,1,0} get-tuple-element(%while.0), index=3
}
"""


def test_slice_copies_counted_per_token_in_place_updates_not():
    t = hlo_traffic(HLO, tokens=4)
    # one 2 MiB slice copy per layer, 2 layers per token; the 512 KiB cache update is in place
    assert t["by_category_mb"] == {"slice copy": round(2 * 512 * 1024 * 4 / 1e6, 2)}
    assert t["written_mb_per_token"] == t["by_category_mb"]["slice copy"]
    assert t["kernels_per_token"] == 2 * 3          # slice fusion, gemm, update fusion per layer
    assert t["top"][0].startswith("slice_fusion f32[512,1024] slice copy x2/token")
