"""Input a hostile client sends: values changed behind ``SamplingParams``' back, stop lists too
long to match, lone surrogates, bodies that never finish, forged Host headers. The server cases
run against a real server on loopback (the default model) or an in-process app over a stub."""

from __future__ import annotations

import pytest
from twinserve.core.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from twinserve.gpu.detokenizer import StopAutomaton


# ---- SamplingParams at the engine's door ---------------------------------------------------------
@pytest.mark.parametrize("field,value,message", [
    ("logprobs", 100_000, "logprobs must be at most 20"),
    ("n", 0, "n must be at least 1"),
    ("temperature", "hot", "temperature must be a number"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers"),
    ("skip_special_tokens", "no", "skip_special_tokens must be a boolean"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be a boolean"),
])
def test_validate_rechecks_attributes_changed_after_construction(field, value, message):
    sp = SamplingParams()
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=message):
        sp.validate()


def test_stop_list_is_bounded_in_count_and_length():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(ValueError, match=r"^stop may hold at most 64 strings, got 90000"):
        SamplingParams(stop=[f"s{i}" for i in range(90_000)])
    with pytest.raises(ValueError, match=r"^stop strings may be at most 256 characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError) as info:  # the message does not echo a huge list
        SamplingParams(stop=["ok"] * 10 + [7] + ["y" * 100] * 50)
    assert len(str(info.value)) < 200


def test_engine_add_request_validates_params(default_model_dir):
    from twinserve.entrypoints.llm import LLM
    llm = LLM(model=str(default_model_dir), max_model_len=128, max_num_seqs=4,
              kv_cache_memory_bytes=16 << 20, dtype="float32")
    sp = SamplingParams(max_tokens=2)
    sp.logprobs = 100_000
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request([1, 2, 3], sp)
    sp = SamplingParams(max_tokens=2)
    sp.n = 0
    with pytest.raises(ValueError, match="^n must be at least 1"):
        llm.engine.add_request([1, 2, 3], sp)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError):
        llm.generate(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SamplingParams\(\*\*"):
        llm.generate(["Hi"], {"max_tokens": 2})  # type: ignore[arg-type]


# ---- stop strings: one automaton, work independent of their number -----------------------------
def _brute_first_stop(stops: list[str], text: str) -> tuple[int, str] | None:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def test_stop_automaton_finds_the_first_stop_to_end():
    import random
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        automaton = StopAutomaton(stops)
        state, pos, found = 0, 0, None
        while pos < len(text):  # fed in pieces, as tokens arrive
            piece = text[pos:pos + rng.randint(1, 3)]
            state, end, index = automaton.feed(state, piece)
            if index != -1:
                found = (pos + end, automaton.stops[index])
                break
            pos += len(piece)
        assert found == _brute_first_stop(stops, text), (stops, text)


def test_64_stop_strings_cost_a_constant_factor_of_one():
    import random
    rng = random.Random(1)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))
    # adversarial stop strings: long shared prefixes that the text keeps almost matching
    many = ["abcdefgh"[:k] * 30 + "Z" for k in range(1, 9)] + \
        ["".join(rng.choice("abcdefgh ") for _ in range(MAX_STOP_STRING_CHARS - 1)) + "Z"
         for _ in range(MAX_STOP_STRINGS - 8)]
    one = StopAutomaton(["Z"]).count_steps(text)
    sixty_four = StopAutomaton(many).count_steps(text)
    assert one == len(text)
    assert sixty_four <= 2 * len(text)  # Aho-Corasick: at most 2 transitions per character
    # the scan it replaced: one str.find per stop string per new piece of text
    assert StopAutomaton(many).feed(0, text)[2] == -1


def test_detokenizer_stops_with_many_stop_strings(default_model_dir):
    from twinserve.gpu.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode("one, two, three, four")
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)] + [" three"]
    detok = tok.detokenizer([], stop=stops)
    assert detok.add_tokens(ids) == " three"
    assert detok.get_delta(finished=True) == "one, two,"
