"""bench_decode.py's parent side: the tiles and layers a later job measures come from earlier rows
(and the child side's reading of them, meshlab/bench/decode_tiles.py)."""
import json
from pathlib import Path

import pytest

from meshlab.bench import decode_tiles as dj
from tests.helpers import script_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bd():
    return script_module("bench_decode")


def _row(job, section, setting, value, **extra):
    return {"job": job, "section": section, "setting": setting, "value": value, "unit": "us", **extra}


def test_matmul_rows_give_each_op_its_fastest_tile(bd, monkeypatch):
    qkv, wo, down = {"gemv_key": "3072,2048,0"}, {"gemv_key": "2048,2048,0"}, {"gemv_key": "2048,8192,0"}
    rows = [_row("matmul", "matmul", "qkv+norm ours[n4] b=1", 7.0, **qkv),
            _row("matmul", "matmul", "qkv+norm ours[n8w8] b=1", 6.5, **qkv),
            _row("matmul", "matmul", "qkv+norm xla b=1", 5.0, **qkv),                   # XLA is not a tile
            _row("matmul", "matmul", "wo+residual ours[n1w1] b=1", float("nan")),      # a failed check: no key
            _row("matmul", "matmul", "wo+residual ours[n4] b=1", 8.0, **wo),
            _row("matmul", "matmul", "down+residual ours[n2k8192p1] b=4", 1.0, **down)]  # batch 4 rows do not count
    tuned = json.loads(bd._gemv_tuned(rows)["MESHLAB_BENCH_GEMV_TUNED"])
    assert tuned == {"3072,2048,0": "n8w8", "2048,2048,0": "n4"}
    monkeypatch.setenv("MESHLAB_BENCH_GEMV_TUNED", json.dumps(tuned))
    monkeypatch.setenv("MESHLAB_BENCH_ATTN", "w8")
    gemv, attn = dj.tile_variant("tuned a:w8")
    assert gemv(3072, 2048, False).block_n == 8 and gemv(3072, 2048, False).num_warps == 8
    assert gemv(2048, 8192, False) == dj.matmul_configs()["n4"]      # an op without a row: the default BlockSizes
    assert attn().num_warps == 8
    monkeypatch.setenv("MESHLAB_BENCH_ATTN", "ppb4,st1_vfirst")
    shipped, attn = dj.tile_variant("a:ppb4")                            # no "tuned": the shipped per-shape tiles
    from pallas_kernels.decode_gemv import shape_block_sizes
    assert shipped is shape_block_sizes and attn().pages_per_block == 4
    assert dj.tile_variant("a:st1_vfirst")[1]().v_first and set(dj.attention_tiles()) == {"ppb4", "st1_vfirst"}
    # after a variant swapped the module's tiles, "no a:" still means the tiles the module ships
    from pallas_kernels import paged_tiles
    shipped_attn = paged_tiles.decode_block_sizes
    monkeypatch.setattr(paged_tiles, "decode_block_sizes", attn)
    assert dj.tile_variant("", shipped_attn=shipped_attn)[1]() == shipped_attn() != attn()
    monkeypatch.setenv("MESHLAB_BENCH_ATTN", "nonesuch")
    with pytest.raises(SystemExit, match="nonesuch"):
        dj.attention_tiles()


def test_engine_choice_takes_the_fastest_mean(bd):
    rows = [_row("engine_gemv", "decode", "engine b=1 ctx=2048 [fused]", 1010.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels]", 1119.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels] again", 1113.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels tuned a:w8]", 1130.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels tuned a:w8] again", 1090.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels a:w8]", 1100.0),
            _row("engine_gemv", "ttft", "engine prompt=2048, all cached [kernels n4]", 1.0)]
    assert bd._engine_choice(rows) == {"MESHLAB_BENCH_LAYERS": "kernels", "MESHLAB_BENCH_GEMV": ""}
    rows.append(_row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels a:w8] again", 1200.0))
    assert bd._engine_choice(rows) == {"MESHLAB_BENCH_LAYERS": "kernels", "MESHLAB_BENCH_GEMV": "a:w8"}


def test_rows_of_another_preset_are_read_with_their_tag(bd):
    """run_job appends " [<preset>]" to the rows of --preset llama3_8b: the choices still read them."""
    key = {"gemv_key": "6144,4096,0"}
    rows = [_row("matmul", "matmul", "qkv+norm ours[n4] b=1 [llama3_8b]", 20.0, **key),
            _row("matmul", "matmul", "qkv+norm ours[n4k4096] b=1 [llama3_8b]", 15.0, **key)]
    assert json.loads(bd._gemv_tuned(rows)["MESHLAB_BENCH_GEMV_TUNED"]) == {"6144,4096,0": "n4k4096"}
    rows = [_row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels] [llama3_8b]", 190.0),
            _row("engine_gemv", "decode", "engine b=1 ctx=2048 [kernels tuned] again [llama3_8b]", 200.0)]
    assert bd._engine_choice(rows) == {"MESHLAB_BENCH_LAYERS": "kernels", "MESHLAB_BENCH_GEMV": "tuned"}
