"""Per-pool engine arguments in the twin's xPyD fleet: each pool runs its own limits."""

from __future__ import annotations

import pytest

from twinserve.entrypoints.cli.main import main
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.disaggregated import replay_fleet
from twinserve.simulator.run import _engine_requests, build_engine_config
from twinserve.traces import SyntheticConfig, synthetic_trace

SMALL = {"model": "llama-3-8b", "hardware": "h100-sxm", "max_num_seqs": 16,
         "max_num_batched_tokens": 2048}
WL = SyntheticConfig(num_requests=40, request_rate=50.0, input_len=300, output_len=40,
                     range_ratio=0.5, seed=5)


def _steps(cfg: SimConfig):
    trace = synthetic_trace(WL)
    build = build_engine_config(cfg)
    fleet, _, _ = replay_fleet(cfg, _engine_requests(trace, build.model.vocab_size, cfg.engine.block_size))
    return fleet, list(fleet.recorder.steps)


def test_each_pool_runs_its_own_max_num_seqs() -> None:
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=1,
                    prefill_args={"max_num_seqs": 1}, decode_args='{"max_num_seqs": 3}')
    fleet, steps = _steps(cfg)
    assert fleet.prefill[0].driver.scheduler.config.max_num_seqs == 1
    assert fleet.decode[0].driver.scheduler.config.max_num_seqs == 3
    assert max(s.num_seqs for s in steps if s.replica == 0) == 1
    assert max(s.num_seqs for s in steps if s.replica == 1) == 3
    _, shared = _steps(SimConfig(**SMALL, prefill_instances=1, decode_instances=1))
    # without pool arguments both pools run more at once: the caps above are the pools' own
    assert max(s.num_seqs for s in shared if s.replica == 0) > 1
    assert max(s.num_seqs for s in shared if s.replica == 1) > 3


def test_a_capped_decode_pool_shows_in_the_run() -> None:
    trace = synthetic_trace(WL)
    base = simulate(SimConfig(**SMALL, prefill_instances=1, decode_instances=1), trace).summary
    capped = simulate(SimConfig(**SMALL, prefill_instances=1, decode_instances=1,
                                decode_args={"max_num_seqs": 2, "max_waiting_requests": 100}),
                      trace).summary
    assert capped["completed"] == base["completed"] == len(trace)
    assert capped["mean_e2el_ms"] > 2 * base["mean_e2el_ms"]


@pytest.mark.parametrize("kwargs, match", [
    ({"decode_args": {"block_size": 32}}, "decode_args: 'block_size' must be the same"),
    ({"prefill_args": {"model": "llama-3-70b"}}, "prefill_args: 'model' must be the same"),
    ({"prefill_args": {"dtype": "float16"}}, "prefill_args: 'dtype' must be the same"),
    ({"decode_args": {"max_num_seq": 2}}, "decode_args: unknown engine argument 'max_num_seq'"),
    ({"decode_args": {"max_num_seqs": 0}}, "decode_args: max_num_seqs must be a positive"),
    ({"decode_args": "[1]"}, "decode_args must be a mapping"),
    ({"decode_args": "{"}, "decode_args is not valid JSON"),
])
def test_pool_args_refused_by_name(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SimConfig(**SMALL, prefill_instances=1, decode_instances=1, **kwargs)


def test_pool_args_need_a_disaggregated_fleet_and_round_trip() -> None:
    with pytest.raises(ValueError, match="prefill_args is set but the fleet is not disaggregated"):
        SimConfig(**SMALL, prefill_args={"max_num_seqs": 4})
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=1,
                    decode_args={"max-num-seqs": 2})
    assert cfg.decode_args == {"max_num_seqs": 2} and cfg.replace().decode_args == {"max_num_seqs": 2}
    assert cfg.pool_engine("decode").max_num_seqs == 2 and cfg.pool_engine("prefill").max_num_seqs == 16
    assert "decode_args" not in SimConfig(**SMALL).flat()  # aggregated runs' files unchanged


def test_simulate_cli_and_config_file_take_pool_args(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    common = ["simulate", "--trace", "synthetic", "--model", "llama-3-8b", "--hardware", "h100-sxm",
              "--num-requests", "20", "--request-rate", "20", "--input-len", "200",
              "--output-len", "20", "--disable-tqdm", "--prefill-instances", "1",
              "--decode-instances", "1"]
    assert main(common + ["--decode-args", '{"max_num_seqs": 2}', "--out", str(out)]) == 0
    assert '"decode_args": {\n    "max_num_seqs": 2' in (out / "config.json").read_text()
    config = tmp_path / "pd.yaml"
    config.write_text("prefill_args:\n  max_num_batched_tokens: 512\ndecode_args:\n"
                      "  max_num_seqs: 4\n")
    assert main(common + ["--config", str(config), "--out", str(tmp_path / "b")]) == 0
    text = (tmp_path / "b" / "config.json").read_text()
    assert '"max_num_batched_tokens": 512' in text and '"max_num_seqs": 4' in text
    capsys.readouterr()
    assert main(common + ["--decode-args", '{"block_size": 32}', "--out", str(tmp_path / "c")]) == 2
    assert "decode_args: 'block_size' must be the same in both pools" in capsys.readouterr().err
