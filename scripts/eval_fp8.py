"""fp8 storage against the model's own on held-out text: python scripts/eval_fp8.py --checkpoint PATH --data FILE.

--data: a prepared token file (.bin beside its meta.json; after `make train`: data/stdlib/val.bin, held
out from training) or a text file. --against kv,weights,weights_w8a16: an fp8 KV cache; fp8 weights as
served (FP8 GEMMs on prompt chunks); the same weights with every GEMM widened. Prints one JSON line
(meshlab/bench/fp8_quality.py says what it holds).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    from meshlab.bench.fp8_quality import main
    main(description=__doc__.splitlines()[0])
