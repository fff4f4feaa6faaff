"""traces/: bundled traces, file formats and their errors, synthetic workloads, transforms, CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from twinserve.traces import (
    LOWEST_TOKEN_ID,
    SyntheticConfig,
    TraceError,
    TraceRequest,
    add_trace_args,
    assign_priorities,
    assign_tenants,
    clip_lengths,
    first_n,
    load_trace,
    repeat,
    scale_time,
    synthetic_trace,
    time_window,
    trace_from_args,
)
from twinserve.traces.trace_request import iter_prompt_token_ids

VOCAB = 49_152


@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    return load_trace("mooncake")


@pytest.fixture(scope="module")
def azure_conv() -> list[TraceRequest]:
    return load_trace("azure-conv")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _jsonl(*objs: dict) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


# --- TraceRequest -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("input_tokens", 0), ("input_tokens", -3), ("output_tokens", 0),
                                         ("output_tokens", -1), ("arrival_time", -1.0),
                                         ("arrival_time", math.nan), ("request_id", "")])
def test_request_validation_names_the_field(field: str, value: object) -> None:
    kwargs = {"request_id": "r", "arrival_time": 0.0, "input_tokens": 10, "output_tokens": 5, field: value}
    with pytest.raises(ValueError, match=field):
        TraceRequest(**kwargs)


def test_the_fast_field_check_passes_only_what_the_plain_checks_pass() -> None:
    """``__post_init__``'s one-test fast path against ``_check_fields``, field by field."""
    good = {"request_id": "r", "arrival_time": 0.5, "input_tokens": 10, "output_tokens": 5,
            "tenant": "t", "priority": 0, "prefix_blocks": (), "prefix_block_tokens": 16,
            "lora": None}
    odd: dict[str, list[object]] = {
        "request_id": ["", 3, None], "arrival_time": [0, 0.0, -0.0, -1e-9, math.inf, math.nan, True, "1"],
        "input_tokens": [1, 0, -2, True, 3.0], "output_tokens": [1, 0, False, 2.0],
        "tenant": ["", 5], "priority": [-(2**63), -(2**63) - 1, 2**70, True, 1.0],
        "prefix_blocks": [[], (1,), (-1,), (1, 2)], "prefix_block_tokens": [1, 0, True],
        "lora": ["a", "", 7]}
    for field, values in odd.items():
        for value in values:
            try:
                r = TraceRequest(**{**good, field: value})
            except ValueError:
                with pytest.raises(ValueError):  # refused by the plain checks themselves
                    _unchecked(**{**good, field: value})._check_fields()
                continue
            r._check_fields()  # accepted: the plain checks accept it too


def _unchecked(**fields: object) -> TraceRequest:
    r = object.__new__(TraceRequest)
    for k, v in fields.items():
        object.__setattr__(r, k, v)
    return r


def test_prefix_blocks_must_fit_the_prompt() -> None:
    TraceRequest("r", 0.0, 33, 1, prefix_blocks=(1, 2, 3))  # last block covers 1 token
    with pytest.raises(ValueError, match="prefix_blocks"):
        TraceRequest("r", 0.0, 32, 1, prefix_blocks=(1, 2, 3))
    with pytest.raises(ValueError, match="prefix_blocks"):
        TraceRequest("r", 0.0, 32, 1, prefix_blocks=(-1,))


def test_prompt_tokens_are_deterministic_and_in_range() -> None:
    req = TraceRequest("golden", 0.0, 20, 1, prefix_blocks=(7,), prefix_block_tokens=8)
    # Golden values: the ids must not change across processes, Python versions or releases.
    assert req.prompt_token_ids(VOCAB) == [44095, 5362, 41916, 22902, 7907, 433, 32181, 5227, 28624,
                                           18072, 1795, 21699, 44917, 14236, 13943, 1366, 26254, 7668,
                                           13374, 20595]
    ids = TraceRequest("x", 0.0, 5000, 1).prompt_token_ids(40)
    assert len(ids) == 5000 and min(ids) == LOWEST_TOKEN_ID and max(ids) == 39
    assert req.prompt_token_ids(VOCAB, block_size=32) == req.prompt_token_ids(VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        req.prompt_token_ids(LOWEST_TOKEN_ID)


def test_prompts_made_in_batches_equal_the_ones_made_one_by_one() -> None:
    rng = np.random.default_rng(3)
    reqs = [TraceRequest("golden", 0.0, 20, 1, prefix_blocks=(7,), prefix_block_tokens=8)]
    for k in range(60):
        n, per_block = int(rng.integers(1, 300)), int(rng.choice([1, 3, 16, 512]))
        blocks = tuple(int(b) for b in rng.integers(0, 2**63, rng.integers(0, (n - 1) // per_block + 2)))
        reqs.append(TraceRequest(f"r{k}", 0.0, n, 1, prefix_blocks=blocks, prefix_block_tokens=per_block))
    reqs += [TraceRequest("g2", 0.0, 11, 1, prefix_blocks=(1, 2, 3), prefix_block_tokens=4),
             TraceRequest("g3", 0.0, 6, 1)]
    one_by_one = [r.prompt_token_ids(VOCAB) for r in reqs]
    # Golden values (made one prompt at a time, before batches existed): a partial last prefix
    # block, and no prefix at all.
    assert one_by_one[-2:] == [[39894, 17118, 48550, 32696, 21631, 40193, 15858, 34207, 7728, 35685,
                                33112], [42614, 48081, 34292, 40649, 9292, 3159]]
    for batch_tokens in (1, 97, 1000, 1 << 16):  # batches of one prompt up to a single batch
        assert list(iter_prompt_token_ids(reqs, VOCAB, batch_tokens)) == one_by_one
    assert list(iter_prompt_token_ids([], VOCAB)) == []
    with pytest.raises(ValueError, match="vocab_size"):
        list(iter_prompt_token_ids(reqs, LOWEST_TOKEN_ID))


def test_shared_prefix_blocks_give_shared_tokens_only() -> None:
    a = TraceRequest("a", 0.0, 100, 1, prefix_blocks=(5, 6, 7))
    b = TraceRequest("b", 0.0, 100, 1, prefix_blocks=(5, 6, 8))
    ta, tb = np.array(a.prompt_token_ids(VOCAB)), np.array(b.prompt_token_ids(VOCAB))
    assert (ta[:32] == tb[:32]).all()
    assert (ta[32:] != tb[32:]).mean() > 0.95  # other blocks and the unique tails differ


# --- bundled traces ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,rows",
                         [("azure-conv", 19_366), ("azure-code", 8_819), ("mooncake", 12_031)])
def test_bundled_trace_loads(name: str, rows: int, request: pytest.FixtureRequest) -> None:
    reqs = request.getfixturevalue(name.replace("-", "_")) if name != "azure-code" else load_trace(name)
    assert len(reqs) == rows
    assert reqs[0].arrival_time == 0.0
    times = [r.arrival_time for r in reqs]
    assert times == sorted(times)
    assert 3000 < times[-1] < 4000  # about one hour
    assert len({r.request_id for r in reqs}) == rows


@pytest.mark.parametrize("name", ["azure-conv", "azure-code", "mooncake"])
def test_bundled_traces_are_stored_in_arrival_order_so_a_limit_reads_their_first_rows(
        name: str) -> None:
    # load_trace(name, limit=n) reads a bundled trace's first n rows only: right because the
    # stable sort by arrival leaves every row where the file has it.
    reqs = load_trace(name)
    assert [r.request_id for r in reqs] == [f"{name}-{i}" for i in range(len(reqs))]
    for n in (1, 2, 2000, len(reqs) - 1, len(reqs), len(reqs) + 5):
        assert load_trace(name, limit=n) == reqs[:n]


def test_a_limit_on_another_file_reads_it_whole(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.csv", PLAIN_HEADER + "5.0,10,2\n2.0,20,3\n9.0,30,4\n")
    assert load_trace(str(path), limit=1) == load_trace(str(path))[:1]
    assert load_trace(str(path), limit=1)[0].request_id == "p-1"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="limit"):
            load_trace(str(path), limit=bad)  # type: ignore[arg-type]


def test_azure_rows_read_by_position_equal_the_general_row_parser(tmp_path: Path) -> None:
    from twinserve.traces import loaders
    text = ("GeneratedTokens, TIMESTAMP ,ContextTokens,ContextTokens\n"
            "44,2023-11-16 18:15:46.6805900,1,374\n"
            "\n"
            "7, 2023-11-16 23:59:59.9 , 12 ,5\n"
            "3,2023-11-17 00:00:01.25,1,+9\n")
    path = _write(tmp_path, "a.csv", text)
    header = [h.strip() for h in text.splitlines()[0].split(",")]
    parse = loaders._azure_row(date_cache={})
    lines = text.splitlines()
    reference = [(i + 1, parse(dict(zip(header, line.split(",")))))
                 for i, line in enumerate(lines) if i and line]
    assert list(loaders._csv_rows(path)) == reference
    assert [(r.input_tokens, r.output_tokens) for r in load_trace(str(path))] == \
        [(374, 44), (5, 7), (9, 3)]


def test_azure_values(azure_conv: list[TraceRequest]) -> None:
    reqs = azure_conv
    assert (reqs[0].input_tokens, reqs[0].output_tokens) == (374, 44)
    assert reqs[1].arrival_time == pytest.approx(50.9951690 - 46.6805900)


def test_mooncake_prefix_sharing(mooncake: list[TraceRequest]) -> None:
    # Rows 0 and 1 have hash_ids [0, 1, ...] and [0, 14, ...]: they share the first 512 tokens only.
    first, second = mooncake[0], mooncake[1]
    assert first.prefix_blocks[:2] == (0, 1) and second.prefix_blocks[:2] == (0, 14)
    t1, t2 = np.array(first.prompt_token_ids(VOCAB)), np.array(second.prompt_token_ids(VOCAB))
    assert (t1[:512] == t2[:512]).all()
    assert (t1[512:1024] != t2[512:1024]).mean() > 0.95


def test_mooncake_partial_last_block(tmp_path: Path) -> None:
    path = _write(tmp_path, "m.jsonl", _jsonl(
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [4, 9]},
        {"timestamp": 2500, "input_length": 700, "output_length": 3, "hash_ids": [4, 9]}))
    a, b = load_trace(str(path))
    assert (a.arrival_time, b.arrival_time) == (0.0, 1.5)
    assert a.num_prefix_tokens == 600 and b.num_prefix_tokens == 700
    ta, tb = a.prompt_token_ids(VOCAB), b.prompt_token_ids(VOCAB)
    assert ta == tb[:600]  # same hash ids: same content as far as the shorter prompt goes


def test_plain_formats_sort_stably_and_share_groups(tmp_path: Path) -> None:
    csv_path = _write(tmp_path, "p.csv", "arrival_time_s,input_tokens,output_tokens,tenant,priority,"
                      "prefix_group,prefix_tokens\n"
                      "5.0,100,10,a,1,sys,40\n"
                      "2.0,50,5,,,,\n"
                      "\n"
                      "5.0,80,8,b,0,sys,40\n")
    reqs = load_trace(str(csv_path))
    assert [r.request_id for r in reqs] == ["p-1", "p-0", "p-2"]
    assert [r.arrival_time for r in reqs] == [0.0, 3.0, 3.0]
    assert (reqs[0].tenant, reqs[0].priority, reqs[0].prefix_blocks) == ("default", 0, ())
    t0, t2 = reqs[1].prompt_token_ids(VOCAB), reqs[2].prompt_token_ids(VOCAB)
    assert t0[:40] == t2[:40] and t0[40:80] != t2[40:80]
    jsonl_path = _write(tmp_path, "q.jsonl", _jsonl(
        {"arrival_time_s": 1.0, "input_tokens": 100, "output_tokens": 10, "tenant": "a",
         "prefix_group": "sys", "prefix_tokens": 40}))
    (only,) = load_trace(str(jsonl_path))
    assert only.prompt_token_ids(VOCAB)[:40] == t0[:40]  # groups are named, not per file


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
PLAIN_HEADER = "arrival_time_s,input_tokens,output_tokens\n"
MOON = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
MALFORMED = [
    ("a.csv", "TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:46.68,3\n", 1, "unknown CSV header"),
    ("a.csv", AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:47.0,-5,44\n", 3, "input_tokens"),
    ("a.csv", AZURE_HEADER + AZURE_ROW + AZURE_ROW + "2023-11-16 18:15:47.0,5,0\n", 4, "output_tokens"),
    ("a.csv", AZURE_HEADER + "2023-11-16T18:15:46,374,44\n", 2, "timestamp"),
    ("a.csv", AZURE_HEADER + AZURE_ROW + "2023-13-16 18:15:46.5,374,44\n", 3, "timestamp"),
    ("a.csv", AZURE_HEADER + AZURE_ROW + "\n" + "2023-11-16 18:15:47.0,5\n", 4, "expected 3 fields"),
    ("a.csv", AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:47.0,five,1\n", 3, "ContextTokens"),
    ("m.jsonl", _jsonl(MOON) + '{"timestamp": 1,\n', 2, "bad JSON"),
    ("m.jsonl", _jsonl(MOON) + "\n" + _jsonl({k: v for k, v in MOON.items() if k != "output_length"}),
     3, "missing column 'output_length'"),
    ("m.jsonl", _jsonl({**MOON, "input_length": -1}), 1, "input_tokens"),
    ("m.jsonl", _jsonl(MOON, {**MOON, "hash_ids": [1, 2, 3]}), 2, "prefix_blocks"),
    ("m.jsonl", _jsonl(MOON, {**MOON, "timestamp": "soon"}), 2, "timestamp"),
    ("m.jsonl", _jsonl(MOON) + "[1, 2]\n", 2, "JSON object"),
    ("p.csv", "arrival_time_s,input_tokens\n1.0,5\n", 2, "missing column 'output_tokens'"),
    ("p.csv", PLAIN_HEADER + "1.0,5,1\nsoon,5,1\n", 3, "arrival_time_s"),
    ("p.csv", PLAIN_HEADER + "1.0,0,1\n", 2, "input_tokens"),
    ("p.csv", PLAIN_HEADER[:-1] + ",prefix_group\n1.0,5,1,sys\n", 2, "prefix_tokens"),
    ("p.csv", PLAIN_HEADER[:-1] + ",prefix_group,prefix_tokens\n1.0,5,1,sys,6\n", 2, "prefix_tokens"),
    ("p.jsonl", _jsonl({"arrival_time_s": 0, "input_tokens": 5, "output_tokens": 1},
                       {"arrival_time_s": 0, "input_tokens": 5, "output_tokens": 1, "priority": 0.5}),
     2, "priority"),
]


@pytest.mark.parametrize("name,text,line,what", MALFORMED)
def test_malformed_file_names_file_and_line(tmp_path: Path, name: str, text: str, line: int,
                                            what: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError, match=what) as info:
        load_trace(str(path))
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_unknown_names_and_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="azure-conv, azure-code, mooncake"):
        load_trace("azure-chat")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(str(_write(tmp_path, "t.txt", "1,2,3\n")))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(str(_write(tmp_path, "e.csv", PLAIN_HEADER)))


# --- synthetic --------------------------------------------------------------------------------------

def test_synthetic_is_seeded() -> None:
    cfg = SyntheticConfig(num_requests=200, request_rate=5.0, range_ratio=0.5, seed=3)
    assert synthetic_trace(cfg) == synthetic_trace(dataclasses.replace(cfg))
    assert synthetic_trace(cfg) != synthetic_trace(dataclasses.replace(cfg, seed=4))


def _gaps(reqs: list[TraceRequest]) -> np.ndarray:
    return np.diff([r.arrival_time for r in reqs])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_synthetic_rate_and_burstiness(burstiness: float) -> None:
    reqs = synthetic_trace(SyntheticConfig(num_requests=20_000, request_rate=8.0, burstiness=burstiness))
    gaps = _gaps(reqs)
    assert reqs[0].arrival_time == 0.0 and (gaps >= 0).all()
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_synthetic_lengths_and_infinite_rate() -> None:
    reqs = synthetic_trace(SyntheticConfig(num_requests=2000, input_len=100, output_len=10,
                                           range_ratio=0.5, prefix_len=20))
    assert all(r.arrival_time == 0.0 for r in reqs)
    inputs = [r.input_tokens for r in reqs]
    assert min(inputs) == 70 and max(inputs) == 170  # prefix + U[50, 150]
    assert {r.output_tokens for r in reqs} == set(range(5, 16))
    fixed = synthetic_trace(SyntheticConfig(num_requests=50, input_len=7, output_len=3))
    assert {(r.input_tokens, r.output_tokens) for r in fixed} == {(7, 3)}


def test_synthetic_tenant_rates() -> None:
    reqs = synthetic_trace(SyntheticConfig(num_requests=10_000, tenant_rates={"heavy": 4.0, "light": 1.0}))
    duration = reqs[-1].arrival_time
    counts = Counter(r.tenant for r in reqs)
    assert counts["heavy"] / duration == pytest.approx(4.0, rel=0.05)
    assert counts["light"] / duration == pytest.approx(1.0, rel=0.08)
    with pytest.raises(ValueError, match="not both"):
        SyntheticConfig(request_rate=2.0, tenant_rates={"a": 1.0})


def test_synthetic_prefix_share_and_priorities() -> None:
    reqs = synthetic_trace(SyntheticConfig(num_requests=4000, input_len=30, prefix_len=64,
                                           prefix_share=0.25, priorities={0: 1.0, 1: 3.0}))
    sharers = [r for r in reqs if r.prefix_blocks]
    assert len(sharers) / len(reqs) == pytest.approx(0.25, abs=0.03)
    assert {r.input_tokens for r in reqs} == {94}
    a, b = sharers[0].prompt_token_ids(VOCAB), sharers[1].prompt_token_ids(VOCAB)
    assert a[:64] == b[:64] and a[64:] != b[64:]
    loner = next(r for r in reqs if not r.prefix_blocks).prompt_token_ids(VOCAB)
    assert loner[:64] != a[:64]
    assert sum(r.priority for r in reqs) / len(reqs) == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("field,value", [("request_rate", 0.0), ("burstiness", -1.0), ("range_ratio", 1.0),
                                         ("prefix_share", 1.5), ("num_requests", 0), ("input_len", 0)])
def test_synthetic_config_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticConfig(**{field: value})


# --- transforms -------------------------------------------------------------------------------------

def _reqs(n: int = 10, gap: float = 1.0) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", i * gap, 100, 10) for i in range(n)]


def test_scale_first_n_and_window() -> None:
    reqs = _reqs()
    assert [r.arrival_time for r in scale_time(reqs, 2.0)] == [i / 2 for i in range(10)]
    assert [r.request_id for r in first_n(reqs, 3)] == ["r0", "r1", "r2"]
    window = time_window(reqs, 2.5, 6.0)
    assert [(r.request_id, r.arrival_time) for r in window] == [("r3", 0.0), ("r4", 1.0), ("r5", 2.0)]
    assert reqs[3].arrival_time == 3.0  # inputs are untouched
    with pytest.raises(ValueError, match="factor"):
        scale_time(reqs, 0.0)
    with pytest.raises(ValueError, match="start_s"):
        time_window(reqs, 5.0, 5.0)


def test_clip_lengths_rule() -> None:
    reqs = [TraceRequest("fits", 0.0, 90, 10), TraceRequest("long-prompt", 0.0, 1000, 10),
            TraceRequest("long-output", 0.0, 50, 500),
            TraceRequest("prefix", 0.0, 1000, 10, prefix_blocks=(1, 2), prefix_block_tokens=512)]
    out = clip_lengths(reqs, 100)
    assert [(r.input_tokens, r.output_tokens) for r in out] == [(90, 10), (90, 10), (1, 99), (90, 10)]
    assert out[0] is reqs[0] and out[3].prefix_blocks == (1,)
    capped = clip_lengths(reqs, 100, max_output_tokens=4)
    assert [(r.input_tokens, r.output_tokens) for r in capped] == [(90, 4), (96, 4), (50, 4), (96, 4)]


def test_assign_tenants_and_priorities() -> None:
    reqs = _reqs(4000)
    tenants = assign_tenants(reqs, {"heavy": 3.0, "light": 1.0}, seed=1)
    assert tenants == assign_tenants(reqs, {"heavy": 3.0, "light": 1.0}, seed=1)
    assert Counter(r.tenant for r in tenants)["heavy"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert all(r.tenant == "default" for r in reqs)
    prios = assign_priorities(reqs, {0: 0.2, 1: 0.8}, seed=2)
    assert sum(r.priority for r in prios) / 4000 == pytest.approx(0.8, abs=0.03)
    assert [r.arrival_time for r in prios] == [r.arrival_time for r in reqs]
    with pytest.raises(ValueError, match="must not all be 0"):
        assign_tenants(reqs, {"a": 0.0})


def test_repeat_keeps_rate_and_ids_unique(mooncake: list[TraceRequest]) -> None:
    reqs = _reqs(5, gap=2.0)
    out = repeat(reqs, 3)
    assert [r.arrival_time for r in out] == [2.0 * i for i in range(15)]
    assert len({r.request_id for r in out}) == 15 and out[5].request_id == "r0~1"
    big = repeat(mooncake, 4)
    assert len(big) == 4 * len(mooncake) and len({r.request_id for r in big}) == len(big)
    times = [r.arrival_time for r in big]
    assert times == sorted(times)
    assert repeat(reqs, 1) == reqs


# --- CLI flags --------------------------------------------------------------------------------------

def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    return parser.parse_args(list(argv))


def test_cli_real_trace_pipeline() -> None:
    reqs = trace_from_args(_parse("--trace", "azure-code", "--time-window", "60:600",
                                  "--num-requests", "100", "--time-scale", "2", "--tenants", "a=3,b=1",
                                  "--priorities", "0=1,2=1", "--max-model-len", "2048", "--seed", "5"))
    assert len(reqs) == 100 and reqs[0].arrival_time == 0.0
    assert reqs[-1].arrival_time < 270.0
    assert {r.tenant for r in reqs} == {"a", "b"} and {r.priority for r in reqs} == {0, 2}
    assert max(r.input_tokens + r.output_tokens for r in reqs) <= 2048


def test_cli_synthetic() -> None:
    args = _parse("--trace", "synthetic", "--num-requests", "300", "--request-rate", "10",
                  "--burstiness", "2", "--input-len", "64", "--output-len", "16", "--prefix-len", "32",
                  "--prefix-share", "0.5")
    reqs = trace_from_args(args)
    assert reqs == trace_from_args(args)
    assert len(reqs) == 300 and {r.input_tokens for r in reqs} == {96}
    assert len(trace_from_args(_parse())) == 19_366  # default: azure-conv


def test_cli_output_cap_applies_before_prompts_are_clipped() -> None:
    raw = trace_from_args(_parse("--num-requests", "300"))
    reqs = trace_from_args(_parse("--num-requests", "300", "--max-model-len", "128",
                                  "--max-output-tokens", "32"))
    for r, c in zip(raw, reqs):  # a prompt keeps room for its capped output, and no more
        assert c.output_tokens == min(r.output_tokens, 32)
        assert c.input_tokens == min(r.input_tokens, 128 - c.output_tokens)
    assert any(c.input_tokens == 96 for c in reqs)
    alone = trace_from_args(_parse("--num-requests", "300", "--max-output-tokens", "32"))
    assert [c.input_tokens for c in alone] == [r.input_tokens for r in raw]


SMALL = ["--trace", "synthetic", "--num-requests", "20"]


@pytest.mark.parametrize("argv,flag", [
    (["--request-rate", "5"], "--request-rate"),
    (["--trace", "synthetic", "--burstiness", "0"], "--burstiness"),
    (["--trace", "synthetic", "--num-requests", "0"], "--num-requests"),
    (["--trace", "synthetic", "--range-ratio", "2"], "--range-ratio"),
    (["--trace", "nope"], "--trace"),
    ([*SMALL, "--time-window", "10"], "--time-window"),
    ([*SMALL, "--time-window", "10:5"], "--time-window"),
    ([*SMALL, "--time-scale", "-1"], "--time-scale"),
    ([*SMALL, "--tenants", "a"], "--tenants"),
    ([*SMALL, "--priorities", "high=1"], "--priorities"),
    ([*SMALL, "--max-model-len", "1"], "--max-model-len"),
    ([*SMALL, "--max-output-tokens", "0"], "--max-output-tokens"),
    ([*SMALL, "--seed", "-1"], "--seed"),
])
def test_cli_errors_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        trace_from_args(_parse(*argv))
