"""Train a model: python scripts/train.py --config CONFIG --rules RULES [--mesh SPEC] [--steps N]
[--run-dir DIR] [--cpu-devices N] [--resume [STEP]] [key=value ...]

Several processes (one per host): set MESHLAB_COORDINATOR/MESHLAB_NUM_PROCESSES/MESHLAB_PROCESS_ID,
pass --coordinator/--num-processes/--process-id, or launch under Slurm / Open MPI
(scripts/launch_slurm.sh). See docs/running.md."""
import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse(argv):
    from meshlab.compat import cpu_devices_arg      # imports jax, not yet a backend: --cpu-devices still applies
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default", help="shipped config name or path to a YAML file")
    p.add_argument("--rules", help="shipped rule file name (e.g. fsdp_tp) or path to a YAML file")
    p.add_argument("--mesh", help="mesh spec overriding the rule file's, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--steps", type=int, help="the run's total steps (the learning-rate schedule's length; default: the config's)")
    p.add_argument("--run-dir", help="where the run writes config, metrics, checkpoints (default: runs/default)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="STEP",
                   help="continue from the run directory's latest checkpoint (or STEP)")
    p.add_argument("--cpu-devices", type=cpu_devices_arg, help="simulate N CPU devices (CPU only)")
    p.add_argument("--peak-tflops", type=float, help="MFU's peak, dense TFLOP/s per device (default: the "
                   "datasheet figure of the device kind; needed where it is not in the table)")
    p.add_argument("--device-memory-gib", type=float, help="memory per device the fit check and remat=auto "
                   "budget against (default: the device's own)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-process runs)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. optim.lr=1e-3")
    args = p.parse_intermixed_args(argv)   # overrides may come before and after flags
    if args.resume not in (None, "latest") and not args.resume.isdigit():
        args.overrides.append(args.resume)    # `--resume key=value`: the flag took an override
        args.resume = "latest"
    return args


def _is_resume_flag(arg: str) -> bool:
    """--resume, --resume=STEP, and the abbreviations argparse accepts for them (--re, --resu=4)."""
    name = arg.split("=", 1)[0]
    return len(name) >= len("--re") and "--resume".startswith(name)


def resume_command(argv: list[str]) -> list[str]:
    """`argv` (the script's path first) as the command that resumes the run: any resume it was
    started with (--resume, --resume STEP, --resume=STEP, checkpoint.resume=...) dropped, then
    --resume (the latest checkpoint) added."""
    out, after_flag = [], False
    for arg in argv:
        # a bare --resume may take the next word as its STEP; an override or a flag there stays
        its_step, after_flag = after_flag and (arg.isdigit() or arg == "latest"), False
        if its_step or arg.startswith("checkpoint.resume="):
            continue
        if _is_resume_flag(arg):
            after_flag = "=" not in arg
            continue
        out.append(arg)
    return [*out, "--resume"]


def main(argv=None):
    args = parse(argv)
    if args.cpu_devices:
        from meshlab.compat import set_cpu_devices
        set_cpu_devices(args.cpu_devices)
    from meshlab.train import distributed
    from meshlab.checkpoint import CheckpointError
    from meshlab.train.config import ConfigError, load_config
    from meshlab.train.fit import OutOfMemoryError
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except distributed.DistributedError as e:
        sys.exit(f"error: {e}")
    from meshlab import compile_cache
    from meshlab.train.loop import train
    import jax
    overrides = list(args.overrides)
    for flag, key in ((args.rules, "rules"), (args.mesh, "mesh"), (args.steps, "steps"),
                      (args.run_dir, "run_dir"), (args.resume, "checkpoint.resume"),
                      (args.peak_tflops, "peak_tflops"), (args.device_memory_gib, "device_memory_gib")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    try:
        cfg = load_config(args.config, overrides)
        compile_cache.enable_for_run(cfg)   # before the first compile: a rerun loads the compiled step
        result = train(cfg)
    except (ConfigError, ValueError, FileNotFoundError, FloatingPointError, CheckpointError,
            distributed.DistributedError, OutOfMemoryError) as e:
        sys.exit(f"error: {e}")
    except Exception as e:
        lost = distributed.peer_failure(e)
        if lost is None:
            raise
        print(f"error: {lost}", file=sys.stderr, flush=True)
        os._exit(3)   # as the watchdog does: JAX's shutdown would wait at its barrier for the dead peer, then abort
    if jax.process_index() != 0:
        return
    if "interrupted" in result:
        command = resume_command(sys.argv if argv is None else ["scripts/train.py", *argv])
        print(f"stopped after step {result['interrupted']}; checkpoint saved in {result['checkpoint_dir']}.\n"
              f"resume with: python {shlex.join(command)}", flush=True)
        return
    losses = result["losses"]
    if losses:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; run directory {result['run_dir']}")
    if "sample" in result:
        print("sample:\n" + result["sample"])


if __name__ == "__main__":
    main()
