"""Train a model: python scripts/train.py --config CONFIG --rules RULES [--mesh SPEC] [--steps N]
[--run-dir DIR] [--cpu-devices N] [key=value ...]"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="default", help="shipped config name or path to a YAML file")
    p.add_argument("--rules", help="shipped rule file name (e.g. fsdp_tp) or path to a YAML file")
    p.add_argument("--mesh", help="mesh spec overriding the rule file's, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--steps", type=int)
    p.add_argument("--run-dir")
    p.add_argument("--cpu-devices", type=int, help="simulate N CPU devices (CPU only)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. optim.lr=1e-3")
    args = p.parse_args(argv)
    if args.cpu_devices:
        from meshlab.compat import set_cpu_devices
        set_cpu_devices(args.cpu_devices)
    from meshlab.mesh import maybe_initialize_distributed
    from meshlab.train.config import ConfigError, load_config
    from meshlab.train.loop import train
    maybe_initialize_distributed()
    overrides = list(args.overrides)
    for flag, key in ((args.rules, "rules"), (args.mesh, "mesh"), (args.steps, "steps"), (args.run_dir, "run_dir")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    try:
        cfg = load_config(args.config, overrides)
        result = train(cfg)
    except (ConfigError, ValueError, FileNotFoundError, FloatingPointError) as e:
        sys.exit(f"error: {e}")
    losses = result["losses"]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; run directory {result['run_dir']}")
    if "sample" in result:
        print("sample:\n" + result["sample"])


if __name__ == "__main__":
    main()
