"""SamplingParams' checks as the API answers them: a setting out of range raises SamplingError naming its
field, which a request's 400 names as the request's field; and any int64 seed, as OpenAI takes, folded
into the engine's int32 seeds the same way every time. No engine: api.parse over the byte tokenizer."""
import pytest

from meshlab.infer import api
from meshlab.infer.sampler import SEED_RANGE, SamplingError, SamplingParams
from meshlab.tokenizer import ByteTokenizer


@pytest.mark.parametrize("kw,param", [
    ({"top_p": 0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"min_tokens": 20}, "min_tokens"),
    ({"min_tokens": 1, "grammar": "start: x"}, "min_tokens"), ({"logit_bias": {1: 500}}, "logit_bias"),
    ({"seed": -1}, "seed"), ({"frequency_penalty": 3}, "frequency_penalty"), ({"stop_token_ids": [300]}, "stop_token_ids"),
    ({"bad_words_ids": [[]]}, "bad_words_ids"), ({"allowed_token_ids": [5], "bad_words_ids": [[5]]}, "bad_words_ids"),
    ({"grammar": ""}, "grammar"), ({"stop": [""]}, "stop"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_validate_names_the_field_at_fault(kw, param):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw).validate(257)
    assert e.value.param == param and isinstance(e.value, ValueError)


def _parse(**body):
    return api.parse({"prompt": "hi", **body}, False, ByteTokenizer(), "m", 128, [256], 4, vocab_size=257)


@pytest.mark.parametrize("body,param", [
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"allowed_token_ids": [104], "bad_words": ["h"]}, "bad_words"),      # the sampler's bad_words_ids
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_a_request_error_names_the_request_field(body, param):
    with pytest.raises(api.BadRequest) as e:
        _parse(**body)
    assert e.value.status == 400 and e.value.param == param, e.value


@pytest.mark.parametrize("seed", [SEED_RANGE, SEED_RANGE - 1, -1, -2 ** 63, 2 ** 63 - 1, 123456789012])
def test_any_int64_seed_is_folded_into_the_engines_range(seed):
    seeds = [p.seed for p in _parse(seed=seed, n=3).params]
    assert all(0 <= s < SEED_RANGE for s in seeds) and len(set(seeds)) == 3
    assert seeds == [p.seed for p in _parse(seed=seed, n=3).params]       # the same seed, the same draws
    assert _parse(seed=seed).params[0].seed == seeds[0]                    # choice 0's whatever n


def test_a_seed_in_range_is_kept():
    assert [p.seed for p in _parse(seed=7, n=2).params] == [7, 8]


@pytest.mark.parametrize("seed", [2 ** 63, -2 ** 63 - 1, 1.5, "3", True])
def test_a_seed_beyond_int64_or_not_an_integer_is_a_400(seed):
    with pytest.raises(api.BadRequest) as e:
        _parse(seed=seed)
    assert e.value.param == "seed" and "integer" in str(e.value)


@pytest.mark.parametrize("top_k,kept", [(256, 256), (257, 0), (10 ** 12, 0)])
def test_a_top_k_past_the_vocabulary_is_off(top_k, kept):
    """top_k >= the vocabulary keeps every token, as off does: it becomes 0, so any integer fits the
    engine's int32 rows."""
    assert _parse(top_k=top_k).params[0].top_k == kept
    assert SamplingParams(top_k=10 ** 12).validate().top_k == 0
