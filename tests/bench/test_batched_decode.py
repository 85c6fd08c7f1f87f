"""The attention tile sweep (meshlab/bench/batched_decode.py) on CPU in interpret mode: every tiling's
row is a time with the plain kernel's output within bf16 of the fp32 reference and the fused kernel's
equal across tilings; a tiling that cannot build is a FAILED row, not an exception."""
import dataclasses
import json

import models
from meshlab.bench import batched_decode as bd
from meshlab.bench.decode import ROW_PREFIX


def _rows(capsys):
    return [json.loads(line[len(ROW_PREFIX):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(ROW_PREFIX)]


def test_tile_sweep_rows_check_their_outputs(capsys):
    cfg = models.preset("tiny")
    tiles = {"default": bd.TILES["default"], "st1_p528": bd.TILES["st1_p528"], "broken": bd.pt.BlockSizes(score="x")}
    bd.attention_tile_sweep(cfg, 1e11, plain=(2,), fused=(2,), ctx=64, layers=2, tiles=tiles)
    rows = {r["setting"].split(" x2L")[0]: r for r in _rows(capsys)}
    assert set(rows) == {f"{kind} attention [{name}]" for kind in ("plain", "fused") for name in tiles}
    for kind in ("plain", "fused"):
        for name in ("default", "st1_p528"):
            row = rows[f"{kind} attention [{name}]"]
            assert row["value"] > 0 and row["batch"] == 2
            assert float(row["note"].split("max error ")[1].split()[0]) < 3e-2, row["note"]
        assert "FAILED ValueError" in rows[f"{kind} attention [broken]"]["note"]
    assert dataclasses.asdict(bd.TILES["batch1"]) == dataclasses.asdict(bd.pt.decode_block_sizes(1))
