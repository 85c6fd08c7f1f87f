"""Session fixtures of the serving tests, each built once per xdist worker so its programs compile once:
the server that test_server*.py share (their "server" group puts them on one worker), an engine compiled
like it, and a tokenizer.json with a chat template; the tiny model and the small-pool engine that
test_infer_engine.py and test_engine_requests.py share (their "infer_engine" group). A module's own
fixture of the same name (several files build their `tiny` otherwise) takes its place there."""
import contextlib
import dataclasses
import json
import os

import pytest
from flax import nnx

import models
from meshlab.infer.engine import Engine
from meshlab.infer.server import Server
from meshlab.tokenizer import ByteTokenizer
from models import model_def
from tests.helpers import tiny_served_model


def _cheap_codegen():
    """What the cheap_codegen marker of these files gives their module fixtures (tests/conftest.py), for
    these session fixtures, which are built before that module fixture is entered."""
    if os.environ.get("MESHLAB_TEST_GPU"):
        return contextlib.nullcontext()
    from tests.helpers import cheap_codegen
    return cheap_codegen()


@pytest.fixture(scope="session")
def server():
    with _cheap_codegen():
        cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
        md = model_def(cfg)
        params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
        engine = Engine(md, params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
        srv = Server(engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, stop_token_ids=[256], body_timeout=1.0,
                     max_body_bytes=4096).start()
    srv.md, srv.params = md, params
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def spare_engine(server):
    """An engine for servers a test changes for good (an API key, a drain), compiled like the shared server's."""
    with _cheap_codegen():
        return Engine(server.md, server.params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)


@pytest.fixture(scope="session")
def templated_tokenizer(tmp_path_factory):
    """A byte-level tokenizer.json (ids < 257, the tiny model's vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers, decoders, trainers
    from meshlab.infer.loading import HFTokenizer
    d = tmp_path_factory.mktemp("tok")
    tk = Tokenizer(tk_models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello world"], trainers.BpeTrainer(
        vocab_size=257, special_tokens=["<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(d / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "[B]",
                                                         "eos_token": {"content": "<|eot|>"}}))
    return HFTokenizer(d / "tokenizer.json", stop_token_ids=[tk.token_to_id("<|eot|>")])


@pytest.fixture(scope="session")
def tiny():
    """tests.helpers.tiny_served_model(): (model def, params, jitted full forward)."""
    with _cheap_codegen():
        return tiny_served_model()


@pytest.fixture(scope="session")
def engine(tiny):
    """13 usable pages of 4 tokens for 4 rows of up to 64 tokens: forces queueing and preemption."""
    md, params, _ = tiny
    with _cheap_codegen():
        return Engine(md, params, max_len=64, max_seqs=4, page_size=4, num_pages=14, chunk=8, steps_per_call=4)
