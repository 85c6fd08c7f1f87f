"""Per parameter: shape, PartitionSpec, bytes per device under a rule file; totals; activation specs.

    python scripts/explain.py --rules fsdp_tp --model llama3_8b --mesh data=1,fsdp=-1,tensor=8 --devices 64

Nothing is allocated and no device is needed: the mesh is sizes only (--devices fills a -1).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import models  # noqa: E402
from meshlab.mesh import MeshError, resolve_sizes  # noqa: E402
from meshlab.plan.explain import describe  # noqa: E402
from meshlab.plan.search import PlanMesh  # noqa: E402
from meshlab.rules import RulesError, load_rules  # noqa: E402
from models import model_def  # noqa: E402


PRESETS = ", ".join(n for *_, presets in models.ARCHITECTURES.values() for n in presets)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", required=True, help="shipped rule file name or path to a .yaml")
    ap.add_argument("--model", required=True, help="preset name: " + PRESETS)
    ap.add_argument("--mesh", default="", help="e.g. data=1,fsdp=-1,tensor=2 (default: the rule file's)")
    ap.add_argument("--devices", type=int, default=8, help="device count a -1 axis fills (default 8)")
    ap.add_argument("--batch", type=int, default=0, help="global batch for the MoE all-to-all bytes (default: 1 row "
                    "per data-parallel rank)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length for the MoE all-to-all bytes and the pipeline "
                    "stages' FLOPs per token (default 4096)")
    a = ap.parse_args(argv)
    try:
        if a.devices < 1:    # 0 would fill a -1 axis with 0 devices and print bytes for a mesh that cannot exist
            raise ValueError(f"--devices {a.devices} must be >= 1 (the device count a -1 axis fills)")
        if a.seq < 1:
            raise ValueError(f"sequence length {a.seq} must be >= 1 (--seq)")
        if a.batch < 0:
            raise ValueError(f"global batch {a.batch} must be >= 1 (--batch; 0 or left out: one row per data-parallel rank)")
        rules = load_rules(a.rules)
        cfg = models.preset(a.model)
        mesh = PlanMesh(resolve_sizes(a.mesh or rules.mesh, a.devices, count_flag="--devices"))
        print(describe(model_def(cfg), rules, mesh, a.batch or None, a.seq))
    except (RulesError, MeshError, KeyError, ValueError) as e:
        print(f"explain.py: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
