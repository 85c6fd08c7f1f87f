"""The README's commands after `make train`, run as a user would: generate.py and serve.py on a run
trained on 8 simulated devices, from a clean working directory of a process that sees one device,
with the corpus absent; nothing may be written outside the run directory (nor inside it)."""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from meshlab import compile_cache
from meshlab.infer.hf import CheckpointError
from meshlab.infer.loading import add_checkpoint_args, load_checkpoint, open_checkpoint, run_model_config, run_tokenizer
from meshlab.checkpoint import write_run_tokenizer
from meshlab.tokenizer import ByteTokenizer
from tests.helpers import record_instances

ROOT = Path(__file__).resolve().parents[2]
# One xdist worker runs the whole file: the `run` fixture (a training subprocess, ~60 s) is trained once, not once per
# worker (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serve_cli")


def fresh_env() -> dict:
    """This machine as a new user has it: no simulated devices (the test process has 8)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    return env


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`make train`, shortened: 2 steps of tiny on fsdp_tp over 8 simulated CPU devices."""
    work = tmp_path_factory.mktemp("train")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "--config", "default", "--rules",
                          "fsdp_tp", "--cpu-devices", "8", "--steps", "2", "--run-dir", "runs/default",
                          "sample_tokens=0", "data.max_bytes=200000", "log_every=1"],
                         cwd=work, env=dict(fresh_env(), XDG_CACHE_HOME=str(tmp_path_factory.mktemp("xdg"))),
                         capture_output=True, text=True, timeout=600)   # train.py's compile cache: not in ~/.cache
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = work / "runs/default"
    assert json.loads((run_dir / "tokenizer_meta.json").read_text())["tokenizer"] == "byte"
    shutil.rmtree(work / "data")                  # serving must not need the corpus
    return run_dir


@pytest.fixture
def clean(tmp_path):
    d = tmp_path / "cwd"
    d.mkdir()
    return d


def user_env(clean) -> dict:
    """fresh_env with the user's cache directory beside the working directory (the serving scripts keep
    jax's compile cache there, as a user's go to ~/.cache)."""
    return dict(fresh_env(), XDG_CACHE_HOME=str(clean.parent / "xdg"))


def test_generate_readme_command(run, clean):
    before = tree(run.parent.parent)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", str(run),
                          "--prompt", "def ", "--max-new-tokens", "12"],
                         cwd=clean, env=user_env(clean), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("def ") and len(out.stdout) > len("def \n")
    assert list(clean.iterdir()) == [] and tree(run.parent.parent) == before


def test_serve_readme_command(run, clean):
    before = tree(run.parent.parent)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve.py"), "--checkpoint", str(run), "--port", "0",
                             "--max-len", "64", "--chunk", "16", "--cpu-devices", "8"],
                            cwd=clean, env=user_env(clean), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else line
        port = int(line.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def ", "max_tokens": 5}))
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200 and body["usage"]["completion_tokens"] >= 1
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200 and json.loads(health.read())["status"] == "ok"
        # SIGTERM while a stream runs: it gets every token it asked for, then the server exits
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def ", "max_tokens": 40, "ignore_eos": True,
                                                                  "stream": True, "stream_options": {"include_usage": True}}))
        resp = conn.getresponse()
        first = resp.readline()
        while not first.startswith(b"data: "):
            first = resp.readline()
        proc.send_signal(signal.SIGTERM)
        events = [e[6:] for e in (first + resp.read()).decode().splitlines() if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 40
        conn.close()
        out, err = proc.communicate(timeout=60)       # drains both pipes: a full one cannot hold the exit
        assert proc.returncode == 0, err[-3000:]
        assert "draining" in out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert list(clean.iterdir()) == [] and tree(run.parent.parent) == before


SIGNAL_TO_A_WORKER_THREAD = """
import signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from meshlab.infer.serve_cli import serve_until_signalled

class Server:
    def drain(self, timeout, cancel):
        return True
    def stop(self):
        print("stopped", flush=True)

worker = threading.Thread(target=time.sleep, args=(60,), daemon=True)
worker.start()
threading.Timer(0.5, signal.pthread_kill, (worker.ident, signal.SIGTERM)).start()
serve_until_signalled(Server(), 1.0)
"""


def test_a_signal_delivered_to_another_thread_still_drains_and_stops():
    """The kernel hands a process signal to any thread; CPython runs the handler only when the main thread
    next executes bytecode, so the main thread must not sleep in an untimed wait."""
    out = subprocess.run([sys.executable, "-c", SIGNAL_TO_A_WORKER_THREAD, str(ROOT)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "draining" in out.stdout and out.stdout.rstrip().endswith("stopped")


def test_restore_reshards_onto_one_device(run, clean, monkeypatch):
    """In a process with 8 devices (the training mesh's count), serving still places params on one."""
    monkeypatch.chdir(clean)
    cfg, md, params, tok = load_checkpoint(str(run))
    leaves = jax.tree.leaves(params)
    assert cfg.name == "tiny" and isinstance(tok, ByteTokenizer)
    assert all(len(x.sharding.device_set) == 1 for x in leaves)
    assert [x.shape for x in leaves] == [a.shape for a in jax.tree.leaves(md.abstract)]
    # a dtype override (serve.py / generate.py --dtype, notebook 05's dtype=) wins over config.yaml's own
    cfg, md, params, _ = load_checkpoint(str(run), dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and md.cfg.dtype == "bfloat16"
    assert list(clean.iterdir()) == []


def test_a_dtype_override_wins_over_the_runs_config(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  name: tiny\n  dtype: float32\n  n_layers: 3\n")
    cfg, _ = run_model_config(tmp_path, {"dtype": "bfloat16"})
    assert (cfg.dtype, cfg.n_layers) == ("bfloat16", 3)
    assert run_model_config(tmp_path, {})[0].dtype == "float32"


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_load(tmp_path):
    """A tokenizer with ids the model has no embedding for: one error at load naming both sizes (not a 400
    blaming each prompt that holds one), for a run and for a Hugging Face directory."""
    import dataclasses
    import numpy as np
    import models
    from tokenizers import Tokenizer, models as tk_models
    from meshlab.infer.hf import save_hf
    from models import model_def
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model:\n  name: tiny\n  vocab_size: 200\n")       # the byte tokenizer: 257
    with pytest.raises(CheckpointError, match="the tokenizer has 257 tokens but the model's vocab_size is 200"):
        load_checkpoint(str(run_dir))
    Tokenizer(tk_models.WordLevel({f"w{i}": i for i in range(280)} | {"[UNK]": 280}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32")
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), model_def(cfg).abstract)
    save_hf(hf_dir, cfg, zeros, tokenizer_json=tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match=f"the tokenizer has 281 tokens but the model's vocab_size is {cfg.vocab_size}"):
        load_checkpoint(str(hf_dir))


def test_mesh_without_rules_is_one_clear_error():
    """The scripts' shared arguments: a serving mesh with no rule file to shard by is refused before loading."""
    import argparse
    ap = argparse.ArgumentParser()
    add_checkpoint_args(ap)
    args = ap.parse_args(["--checkpoint", "random:tiny", "--mesh", "tensor=2"])
    with pytest.raises(ValueError, match="--mesh tensor=2 needs --rules"):
        open_checkpoint(args)


def test_random_checkpoint_and_device_count_mistakes_are_one_line(capsys):
    """random:<preset>[:<seed>] names the part at fault; --cpu-devices below 1 is a usage error (0 used to be
    ignored, -1 stopped inside JAX's backend set-up)."""
    import argparse
    with pytest.raises(CheckpointError, match="random:tinyy: unknown model 'tinyy'; known: tiny"):
        load_checkpoint("random:tinyy")
    for spec in ("random:tiny:x", "random:tiny:1:2"):
        with pytest.raises(CheckpointError, match="the seed after tiny: must be a whole number, e.g. random:tiny:0"):
            load_checkpoint(spec)
    ap = argparse.ArgumentParser()
    add_checkpoint_args(ap)
    for n in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--checkpoint", "random:tiny", "--cpu-devices", n])
        assert "argument --cpu-devices:" in capsys.readouterr().err
    assert ap.parse_args(["--checkpoint", "random:tiny", "--cpu-devices", "2"]).cpu_devices == 2


def test_a_cache_larger_than_the_devices_is_refused_before_it_is_allocated():
    """A KV cache past the devices' memory (here the host's RAM) stops at once with the settings named, rather
    than an allocation that runs for minutes (host page tables of 2**31 entries, then the device's)."""
    from meshlab.infer.engine import ContiguousGenerator, Engine
    cfg, md, params, _ = load_checkpoint("random:tiny")
    with pytest.raises(ValueError, match=r"the KV cache of [\d,]+ tokens \(max_seqs=16, max_len=2147483648, .*GiB, more "
                                         r"than the 1 device\(s\) hold"):
        Engine(md, params, max_len=2**31, max_seqs=16)
    with pytest.raises(ValueError, match=r"\(batch=1, max_len=2147483648\) takes"):
        ContiguousGenerator(md, params, batch=1, max_len=2**31, chunk=256)


def test_help_shows_the_defaults(capsys):
    """--help names each flag's default (the port, the context, the sampling settings), once: not where
    the help text already says it, and not for flags without one."""
    import runpy
    from meshlab.infer.serve_cli import serve_parser
    text = " ".join(serve_parser().format_help().split())
    assert "(default: 8000)" in text and "(default: 2048)" in text and "(default: 127.0.0.1)" in text
    assert "(default: every row full)" in text and "(default: None)" not in text and "(default: False)" not in text
    generate = runpy.run_path(str(ROOT / "scripts/generate.py"), run_name="generate")
    with pytest.raises(SystemExit):
        generate["main"](["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0: greedy (default: 0.0)" in text and "(default: 64)" in text and "--seed SEED the draws' seed" in text


def test_a_port_outside_tcps_range_is_refused(capsys):
    """--port 70000 would otherwise listen on 70000 mod 65536 = 4464."""
    from meshlab.infer.serve_cli import serve_parser
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--checkpoint", "random:tiny", "--port", "70000"])
    assert "70000 is not a TCP port (0-65535" in capsys.readouterr().err
    assert serve_parser().parse_args(["--checkpoint", "random:tiny", "--port", "0"]).port == 0


def test_an_unknown_warmup_kind_is_one_clear_error():
    """serve.py --warmup-kinds names kinds of requests (meshlab/infer/warmup.py); a typo stops it before loading."""
    import runpy
    serve = runpy.run_path(str(ROOT / "scripts/serve.py"), run_name="serve")
    with pytest.raises(SystemExit, match="--warmup-kinds greedy,sampeld: each must be one of greedy, sampled"):
        serve["main"](["--checkpoint", "random:tiny", "--warmup-kinds", "greedy,sampeld"])


def test_a_second_start_loads_its_programs_from_the_compile_cache(clean):
    """--compile-cache (default: under $XDG_CACHE_HOME): generate.py run again loads what it compiled
    (jax logs each hit; the tiny model's programs compile in under jax's default 1 s, and are kept too)."""
    env = dict(user_env(clean), JAX_LOG_COMPILES="1")
    env.pop(compile_cache.MIN_COMPILE_ENV, None)
    cache = clean.parent / "xdg" / "meshlab" / "jax"
    outs = [subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", "random:tiny",
                            "--prompt", "ab", "--max-new-tokens", "3"], cwd=clean, env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(o.returncode == 0 for o in outs), outs[-1].stderr[-3000:]
    assert f"compile cache: {cache}" in outs[0].stderr and any(cache.iterdir())
    hit = "Persistent compilation cache hit"
    assert hit not in outs[0].stderr and hit in outs[1].stderr and outs[0].stdout == outs[1].stdout
    assert f"{hit} for 'jit_decode_loop'" in outs[1].stderr          # the engine's own program, not only small ones
    off = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", "random:tiny",
                          "--prompt", "ab", "--max-new-tokens", "3", "--compile-cache", ""], cwd=clean, env=env,
                         capture_output=True, text=True, timeout=300)
    assert "compile cache: off (--compile-cache is empty)" in off.stderr and hit not in off.stderr
    assert list(clean.iterdir()) == []


def test_missing_checkpoint_is_one_clear_error(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  name: tiny\n")
    with pytest.raises(RuntimeError, match="no checkpoint directory; train the run first"):
        load_checkpoint(str(tmp_path))


def test_run_keeps_its_tokenizer_json(tmp_path):
    """A run on a tokenizer.json corpus holds a copy (with its chat template): serving reads no corpus."""
    from tokenizers import Tokenizer, models as tk_models
    corpus, tok_dir, run_dir = tmp_path / "corpus", tmp_path / "tok", tmp_path / "run"
    for d in (corpus, tok_dir, run_dir):
        d.mkdir()
    Tokenizer(tk_models.WordLevel({"a": 0, "b": 1, "<eot>": 2, "[UNK]": 3}, unk_token="[UNK]")).save(
        str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    (corpus / "meta.json").write_text(json.dumps({"tokenizer": str(tok_dir), "vocab_size": 4, "eod_id": 2}))
    write_run_tokenizer(str(corpus), run_dir)
    shutil.rmtree(corpus)
    shutil.rmtree(tok_dir)
    tok = run_tokenizer(run_dir, {"data": {"corpus": str(corpus)}})
    assert tok.vocab_size == 4 and tok.stop_token_ids == [2]
    assert tok.chat_template([{"role": "user", "content": "a b"}]) == "a b"
    (run_dir / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        run_tokenizer(run_dir, {"data": {"corpus": str(corpus)}})


def test_a_step_budget_below_the_rows_is_one_clear_error(clean):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/serve.py"), "--checkpoint", "random:tiny", "--port", "0",
                          "--max-seqs", "8", "--max-step-tokens", "8", "--warmup", "off"],
                         capture_output=True, text=True, cwd=clean, env=user_env(clean), timeout=300)
    assert out.returncode == 1 and "serve: max_step_tokens=8 must exceed max_seqs=8" in out.stderr, out.stderr[-2000:]
    assert list(clean.iterdir()) == []


def test_fp8_on_layers_that_cannot_read_it_is_one_clear_error(clean):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/serve.py"), "--checkpoint", "random:tiny", "--port", "0",
                          "--quantize", "fp8", "--layers", "fused", "--warmup", "off"],
                         capture_output=True, text=True, cwd=clean, env=user_env(clean), timeout=300)
    assert out.returncode == 1 and "serve: quantize='fp8'" in out.stderr and "needs layers='kernels'" in out.stderr, \
        out.stderr[-2000:]
    assert list(clean.iterdir()) == []


def test_serve_with_an_fp8_kv_cache(clean, monkeypatch):
    """--kv-cache-dtype fp8 reaches the engine: its cache is float8_e4m3fn (the line the start prints
    says so, with its size), and the server answers."""
    from meshlab.infer.kv_cache import summary
    from meshlab.infer.serve_cli import serve_parser, start_server
    monkeypatch.chdir(clean)
    args = serve_parser().parse_args(["--checkpoint", "random:tiny", "--port", "0", "--max-len", "64", "--chunk", "16",
                                      "--warmup", "off", "--stats-interval", "0", "--kv-cache-dtype", "fp8",
                                      "--compile-cache", ""])
    server = start_server(args)
    try:
        assert server.engine.cache["k"].dtype == jax.numpy.float8_e4m3fn
        # the tiny model: 16 rows of 64 tokens, 64 pages of 16 a row + page 0; 2 layers x 4 kv heads x 16 dims
        assert summary(server.engine.cache) == "KV cache: 64 pages of 16 tokens (1,024 tokens), 0.00 GiB of float8_e4m3fn"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def ", "max_tokens": 4, "ignore_eos": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 4
        conn.close()
    finally:
        server.stop()
    assert list(clean.iterdir()) == []


def test_generate_names_its_flags_in_its_errors(clean, monkeypatch, capsys):
    """generate.py's bad input is one line naming the flag, not a traceback nor SamplingParams' field names."""
    import runpy
    monkeypatch.chdir(clean)
    generate = runpy.run_path(str(ROOT / "scripts/generate.py"), run_name="generate")
    for argv, words in ((["--prompt", ""], "--prompt is empty"), (["--prompt", "a", "--max-new-tokens", "0"],
                                                                  "--max-new-tokens must be >= 1, got 0"),
                        (["--prompt", "a", "--top-p", "0"], "generate: --top-p 0.0 must be a number in (0, 1]")):
        with pytest.raises(SystemExit) as stop:
            generate["main"](["--checkpoint", "random:tiny", "--compile-cache", "", *argv])
        assert words in (str(stop.value.code) + capsys.readouterr().err), argv
    assert list(clean.iterdir()) == []


@pytest.mark.parametrize("flag", ["--kv-cache-dtype", "--quantize"])
def test_generate_with_fp8_storage(clean, monkeypatch, capsys, flag):
    """generate.py --kv-cache-dtype fp8 builds its generator over a float8_e4m3fn cache, --quantize fp8 over
    float8_e4m3fn matrices, and each completes."""
    import runpy
    from meshlab.infer import engine
    made = record_instances(monkeypatch, engine, "ContiguousGenerator")
    monkeypatch.chdir(clean)
    generate = runpy.run_path(str(ROOT / "scripts/generate.py"), run_name="generate")
    generate["main"](["--checkpoint", "random:tiny", "--prompt", "ab", "--max-new-tokens", "3", flag, "fp8",
                      "--compile-cache", ""])
    stored = made[0].cache["k"] if flag == "--kv-cache-dtype" else made[0].params["layers"][0][1]["decode"]["w_down_t"]
    assert stored.dtype == jax.numpy.float8_e4m3fn and capsys.readouterr().out.startswith("ab")
    assert list(clean.iterdir()) == []


def test_check_serve_help_is_its_own_and_checkpoint_equals_is_kept(capsys, monkeypatch):
    """scripts/check_serve.py --help printed serve.py's usage under 'serve.py did not start (exit 0)', and
    --checkpoint=PATH was not seen as a checkpoint, so random:llama3_1b was appended after it and won."""
    from tests.helpers import script_module
    check = script_module("check_serve")
    with pytest.raises(SystemExit) as e:
        check.main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("Check scripts/serve.py end to end")
    started = []

    class NotStarting:          # the server's process, exiting at once: check_serve stops with one line
        stdout = type("Out", (), {"readline": staticmethod(lambda: "")})()

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def wait(self, timeout=None):
            return 1

        def terminate(self):
            pass

    monkeypatch.setattr(check.subprocess, "Popen", NotStarting)
    for args in (["--checkpoint=runs/x"], ["--checkpoint", "runs/x"]):
        with pytest.raises(SystemExit, match=r"serve.py did not start \(exit 1\)"):
            check.main(args)
        cmd = started.pop()
        assert cmd[-len(args):] == args and not any("random:" in a for a in cmd)


@pytest.mark.parametrize("flag,value,words", [
    ("--max-seqs", "0", "argument --max-seqs: 0 must be >= 1"),
    ("--max-len", "-1", "argument --max-len: -1 must be >= 1"),
    ("--page-size", "0", "argument --page-size: 0 must be >= 1"),
    ("--num-pages", "1", "argument --num-pages: 1 must be >= 2 (page 0 is reserved)"),
    ("--chunk", "0", "argument --chunk: 0 must be >= 1"),
    ("--steps-per-call", "0", "argument --steps-per-call: 0 must be >= 1"),
    ("--max-concurrent", "0", "argument --max-concurrent: 0 must be >= 1"),
    ("--max-waiting", "-1", "argument --max-waiting: -1 must be >= 1"),
    ("--max-body-bytes", "0", "argument --max-body-bytes: 0 must be >= 1"),
    ("--body-timeout", "0", "argument --body-timeout: 0 must be a number of seconds > 0"),
    ("--stats-interval", "nan", "argument --stats-interval: nan must be a number of seconds >= 0 (0: none)"),
    ("--shutdown-timeout", "inf", "argument --shutdown-timeout: inf must be a number of seconds >= 0"),
    ("--prompt-lookup-min", "0", "argument --prompt-lookup-min: 0 must be >= 1"),
    ("--speculative-max-batch", "0", "argument --speculative-max-batch: 0 must be >= 1"),
    ("--max-len", "1e3", "argument --max-len: invalid int value: '1e3'"),
    ("--dtype", "fp32", "argument --dtype: invalid choice: 'fp32'"),
])
def test_a_serving_count_below_its_floor_is_a_usage_error(capsys, flag, value, words):
    """Each would otherwise start a server that refuses every request (--max-concurrent 0: all 429, --max-body-bytes 0:
    all 413), fail inside the engine (a zero size), or name the model's field instead of the flag (--dtype)."""
    from meshlab.infer.serve_cli import serve_parser
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--checkpoint", "random:tiny", f"{flag}={value}"])
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--max-len", "100"], "--page-size 16 must divide --max-len 100 (a row holds whole pages), e.g. --max-len 112"),
    (["--max-len", "8"], "--page-size 16 must divide --max-len 8 (a row holds whole pages), lower --page-size"),
    (["--max-len", "64", "--num-pages", "4"], "--num-pages 4 cannot hold one request of --max-len 64: that takes 4 pages "
                                              "of --page-size 16, and page 0 is reserved; pass --num-pages >= 5"),
    (["--max-len", "64", "--speculative-tokens", "64"], "--speculative-tokens 64 must be below --max-len 64"),
    (["--speculative-tokens", "2", "--prompt-lookup-max", "65"], "--prompt-lookup-max 65 must be <= 64"),
    (["--prompt-lookup-min", "4", "--prompt-lookup-max", "3"], "--prompt-lookup-min 4 must be <= --prompt-lookup-max 3"),
    (["--attention", "pallas"], "--attention pallas runs the Pallas paged-attention kernels compiled, which needs a GPU"),
])
def test_serving_flags_that_do_not_fit_together_are_one_clear_error(clean, monkeypatch, argv, words):
    """Refused at start (the Pallas kernels: before the first request's compile, which failed with a traceback in
    the server's log and a 500), naming the flags."""
    from meshlab.infer.serve_cli import serve_parser, start_server
    if "pallas" in argv and jax.default_backend() == "gpu":
        pytest.skip("the Pallas kernels run here")
    monkeypatch.chdir(clean)
    args = serve_parser().parse_args(["--checkpoint", "random:tiny", "--port", "0", "--warmup", "off",
                                      "--compile-cache", "", *argv])
    with pytest.raises(ValueError, match=re.escape(words)):
        start_server(args)
    assert list(clean.iterdir()) == []


def test_speculative_drafts_that_cannot_fit_a_row_are_refused(clean, monkeypatch, capsys):
    """A step feeds a row its last token and k drafts: k >= the row's length never fits (an int32 overflow inside
    the lookup for a huge k); generate.py names its flags, Engine its arguments."""
    import runpy
    from meshlab.infer.engine import Engine
    from tests.helpers import tiny_served_model
    md, params, _ = tiny_served_model()
    with pytest.raises(ValueError, match="speculative_tokens=16 must be below max_len=16"):
        Engine(md, params, max_len=16, speculative_tokens=16)
    with pytest.raises(ValueError, match="prompt_lookup_max=65 must be <= 64"):
        Engine(md, params, max_len=16, speculative_tokens=1, prompt_lookup_max=65)
    monkeypatch.chdir(clean)
    generate = runpy.run_path(str(ROOT / "scripts/generate.py"), run_name="generate")
    with pytest.raises(SystemExit) as stop:
        generate["main"](["--checkpoint", "random:tiny", "--compile-cache", "", "--prompt", "ab", "--max-new-tokens", "2",
                          "--speculative-tokens", "1000000000000"])
    assert ("generate: --speculative-tokens 1000000000000 must be below 16, the row's tokens (the prompt's 2 and "
            "--max-new-tokens 2, in pages of 16)") in str(stop.value.code)
    assert list(clean.iterdir()) == []


def test_the_printed_address_is_one_a_client_can_dial():
    from meshlab.infer.serve_cli import listen_url
    assert listen_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert listen_url("", 8000) == "http://0.0.0.0:8000"          # '' binds every interface
    assert listen_url("::1", 8001) == "http://[::1]:8001"
