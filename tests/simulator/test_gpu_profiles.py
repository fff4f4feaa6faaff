"""GPU profiles fitted to Vidur's public operator measurements, the run folder saying which
profile and data a run used, and the run-folder writer's fast path against its plain version."""

from __future__ import annotations

import csv
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from twinserve.core import run_dir
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.calibration import output_of
from twinserve.simulator.cost_model import CostModel, FittedCostModel, make_cost_model
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.vidur_extract import KEPT, cut_all_reduce, cut_mlp, git_show
from twinserve.simulator.vidur_network import fit_all_reduce, load_all_reduce, ring, size_band
from twinserve.simulator.vidur_profiles import (
    DATASETS,
    NCCL_LAUNCH_MS,
    PROFILE_NETWORKS,
    VIDUR_DIR,
    OperatorStep,
    all_samples,
    fit_dataset,
    load_mlp,
    operator_samples,
)
from twinserve.traces import SyntheticConfig, synthetic_trace


@pytest.fixture(scope="module")
def datasets():
    return all_samples()


def test_each_calibrated_profile_loads_with_its_source_and_stated_error() -> None:
    assert DATASETS
    for ds in DATASETS:
        hardware = load_hardware(ds.hardware)
        for model, tp in ((m, tp) for m in ds.models for tp in ds.tensor_parallel_sizes):
            params = hardware.find_fitted(model, tp)
            assert params is not None, (ds.hardware, model, tp)
            assert params.source.startswith(f"vidur:{ds.sku}/{ds.vidur_model}")
            if ds.measured_attention(tp):
                assert "attention.csv" in params.source
            else:  # which operators are measured, which are the roofline's
                assert "linear operators measured" in params.source
                assert "attention and KV-cache writes on the roofline" in params.source
                assert ("all-reduce measured" in params.source) == (tp > 1)
            assert {"prefill_max", "decode_max", "mixed_max", "all_mape"} <= set(params.fit_error)
            cost = make_cost_model(load_model_spec(model), hardware, tp)
            assert isinstance(cost, FittedCostModel)
    assert {(ds.sku, tp) for ds in DATASETS for tp in ds.tensor_parallel_sizes} >= {
        ("a100", 1), ("a100", 2), ("a100", 8), ("h100", 1), ("h100", 2), ("h100", 8)}
    assert (VIDUR_DIR / "LICENSE").read_text().lstrip().startswith("MIT License")
    provenance = (VIDUR_DIR / "PROVENANCE.md").read_text()
    assert "7d47513363ec447a741ac5e47241580b47724fbf" in provenance
    for kept in KEPT:
        assert (VIDUR_DIR / kept.name).is_file() and kept.source in provenance, kept


MEASURED_POINTS = (OperatorStep(decode=(1, 1728)), OperatorStep(decode=(64, 672)),
                   OperatorStep(decode=(344, 1664)), OperatorStep(prefill=(448, 4032)),
                   OperatorStep(prefill=(4736, 0)))
GRID_POINTS = (OperatorStep(decode=(1, 1024)), OperatorStep(decode=(64, 2048)),
               OperatorStep(decode=(256, 512)), OperatorStep(prefill=(512, 0)),
               OperatorStep(prefill=(2048, 512)))


def test_the_twin_lands_on_the_measured_operators_within_the_stated_fit_error(datasets) -> None:
    for data in datasets:
        ds, tp = data.dataset, data.tensor_parallel_size
        hardware = load_hardware(ds.hardware)
        cost = make_cost_model(load_model_spec(ds.models[0]), hardware, tp)
        stated = hardware.find_fitted(ds.models[0], tp).fit_error
        measured = dict(zip(data.steps, data.samples))
        points = MEASURED_POINTS if ds.measured_attention(tp) else GRID_POINTS
        for step in [*points, *[s for s in data.steps if s.kind == "mixed"][:3]]:
            sample = measured[step]
            predicted = cost.step_time(output_of(sample.aggregates))
            error = 100 * abs(predicted - sample.seconds) / sample.seconds
            assert error <= stated[f"{step.kind}_max"] + 1e-6, (ds.vidur_model, tp, step, error)
        errors = [abs(cost.step_time(output_of(s.aggregates)) - s.seconds) / s.seconds
                  for s in data.samples]
        assert 100 * sum(errors) / len(errors) == pytest.approx(stated["all_mape"], abs=0.01)


def test_the_stored_fit_is_the_fit_of_the_bundled_data(datasets) -> None:
    for data in datasets:
        refit = fit_dataset(data, data.dataset.models[0])
        stored = load_hardware(data.dataset.hardware).find_fitted(data.dataset.models[0],
                                                                  data.tensor_parallel_size)
        assert refit.fit_error == stored.fit_error and refit.source == stored.source
        for name, value in stored.coefficients.items():
            assert refit.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-15)


def test_vidur_composition_sums_the_measured_operators() -> None:
    ds = DATASETS[0]
    mlp = load_mlp(VIDUR_DIR / ds.mlp_file)
    with (VIDUR_DIR / ds.mlp_file).open() as f:
        row = next(r for r in csv.DictReader(f)
                   if r["num_tensor_parallel_workers"] == "1" and r["num_tokens"] == "64")
    by_hand = sum(float(v) for k, v in row.items() if k.endswith("_ms") and k != "emb_ms")
    assert mlp.at(64) == pytest.approx(by_hand)
    assert mlp.tokens[0] <= 60 <= mlp.tokens[-1] and mlp.at(56) < mlp.at(60) < mlp.at(64)
    with pytest.raises(ValueError, match="outside"):
        mlp.at(10**7)


def test_a_step_without_attention_data_sums_measured_operators_all_reduces_and_roofline() -> None:
    ds = next(d for d in DATASETS if d.sku == "h100" and 2 in d.tensor_parallel_sizes
              and d.num_layers == 80)
    data = operator_samples(ds, 2)
    step = OperatorStep(decode=(64, 2048))
    sample = dict(zip(data.steps, data.samples))[step]
    spec = load_model_spec(ds.models[0])
    network = load_all_reduce(VIDUR_DIR / f"{ds.network}_all_reduce.csv")
    layer_ms = (load_mlp(VIDUR_DIR / ds.mlp_file, 2).at(64)
                + 2 * (network.at_ms(2, 64 * spec.hidden_size * 2) + NCCL_LAUNCH_MS))
    roofline = CostModel(spec, load_hardware(ds.hardware), 2)
    attention_s = roofline.breakdown(output_of(step.aggregates())).attention_s
    assert sample.seconds == pytest.approx(80 * layer_ms * 1e-3 + attention_s, rel=1e-12)
    assert 0 < attention_s < sample.seconds / 2
    # only steps whose all-reduce was measured: no extrapolation past the data
    most = max(s.num_tokens for s in data.steps)
    assert most * spec.hidden_size * 2 <= network.max_size(2)
    with pytest.raises(ValueError, match="outside the measured"):
        network.at_ms(2, network.max_size(2) + 1)


def test_the_profiles_link_terms_are_the_all_reduce_fit_within_its_stated_error() -> None:
    for hardware_name, network in PROFILE_NETWORKS.items():
        profile = load_hardware(hardware_name)
        table = load_all_reduce(VIDUR_DIR / f"{network}_all_reduce.csv")
        fit = fit_all_reduce(table)
        assert profile.interconnect_latency_s == pytest.approx(fit.latency_s, rel=1e-9)
        assert profile.interconnect_bandwidth == pytest.approx(fit.bandwidth, rel=1e-9)
        assert dict(profile.interconnect_fit_error) == fit.fit_error
        assert f"network/{network}/all_reduce.csv" in profile.interconnect_source
        assert table.num_workers == (2, 4, 8)
        stated = profile.interconnect_fit_error
        for n in table.num_workers:
            for size in (2**20 + 2**19, 2**21, 2**24, 2**26):
                sizes, ms = table.points[n]
                measured = ms[sizes.index(size)] * 1e-3
                predicted = (profile.interconnect_latency_s
                             + ring(n) * size / profile.interconnect_bandwidth)
                error = 100 * abs(predicted - measured) / measured
                assert error <= stated[f"{size_band(size)}_max"], (network, n, size, error)
        apes = [abs(fit.seconds(n, s) - ms * 1e-3) / (ms * 1e-3) for n, s, ms in table.rows()]
        assert 100 * sum(apes) / len(apes) == pytest.approx(stated["all_mape"], abs=0.01)
    # the roofline at TP > 1 times its all-reduces with them
    spec, a100 = load_model_spec("llama-2-13b"), load_hardware("a100-80gb")
    out = output_of(OperatorStep(decode=(32, 1024)).aggregates())
    per_token = 2 * spec.num_hidden_layers * spec.hidden_size * spec.dtype_bytes
    expected = (2 * spec.num_hidden_layers * a100.interconnect_latency_s
                + ring(4) * 32 * per_token / a100.interconnect_bandwidth)
    assert CostModel(spec, a100, 4).breakdown(out).allreduce_s == pytest.approx(expected, rel=1e-9)


def test_a_calibration_measuring_the_links_replaces_the_fitted_ones_and_says_so(tmp_path: Path) -> None:
    from twinserve.simulator.calibration import Calibration, save_profile
    from twinserve.simulator.hardware import FittedParams
    cal = Calibration(FittedParams(0.01, {}, model="llama-3-8b", tensor_parallel_size=2))
    path = save_profile(cal, "llama-3-8b", "a100-80gb", tmp_path / "p.json", interconnect=(5e10, 2e-5))
    profile = load_hardware(path)
    assert (profile.interconnect_bandwidth, profile.interconnect_latency_s) == (5e10, 2e-5)
    assert profile.interconnect_source.startswith("measured by twinserve calibrate")
    assert not profile.interconnect_fit_error and "vidur" not in profile.interconnect_source


def test_the_kept_files_are_cut_from_vidurs_files() -> None:
    mlp = ("time_stats.emb.median,a,num_tensor_parallel_workers,num_tokens\n"
           "0.5,x,2,8\n0.7,x,2,8\n0.30000000000000004,x,1,8\n")
    text = mlp.replace("time_stats.emb.median", ",".join(
        f"time_stats.{op}.median" for op in ("emb", "input_layernorm", "attn_pre_proj", "attn_rope",
                                             "attn_post_proj", "post_attention_layernorm",
                                             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")))
    text = text.replace("\n0.5,", "\n" + "0.5," * 10).replace("\n0.7,", "\n" + "0.7," * 10)
    text = text.replace("\n0.30000000000000004,", "\n" + "0.30000000000000004," * 10)
    rows = cut_mlp(text)
    assert [r[:3] for r in rows[1:]] == [["1", "8", "0.3"], ["2", "8", "0.5"]]  # first of a key
    network = ("time_stats.all_reduce.median,num_workers,size,collective,devices_per_node\n"
               "0.1,4,2048,all_reduce,2\n0.2,4,2048,all_reduce,4\n0.3,4,2048,all_reduce,4\n")
    assert cut_all_reduce(network) == [["num_workers", "size", "all_reduce_ms"], ["4", "2048", "0.2"]]
    mirror = Path("/work/.mirror/microsoft+vidur/repo")
    if not mirror.is_dir():
        pytest.skip("no git copy of microsoft/vidur here to re-cut the bundled files from")
    for kept in KEPT:
        _, source = git_show(mirror, kept.source)
        cut = (cut_all_reduce if kept.is_network else cut_mlp)(source.decode())
        with (VIDUR_DIR / kept.name).open(newline="") as f:
            assert list(csv.reader(f)) == cut, kept.name


def test_a_tp2_run_uses_the_fitted_profile_and_falls_back_to_the_roofline_saying_so() -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=10, input_len=300, output_len=8, seed=5))
    for hardware, model, sku in (("a100-80gb", "llama-3-8b", "a100"), ("h100", "llama-2-7b", "h100"),
                                 ("h100", "llama-2-70b", "h100")):
        result = simulate(SimConfig(hardware=hardware, model=model, tensor_parallel_size=2), trace)
        assert f"fitted to vidur:{sku}/" in result.cost_model and "at TP 2" in result.cost_model
        assert "all-reduce measured" in result.cost_model and "on the roofline" in result.cost_model
        assert result.summary["completed"] == 10
    fallback = simulate(SimConfig(hardware="a100-80gb", model="llama-2-13b",
                                  tensor_parallel_size=2), trace)
    assert "roofline (uncalibrated" in fallback.cost_model
    assert "no fit for llama-2-13b at TP 2" in fallback.cost_model
    assert "all-reduce fitted to vidur:network/a100_dgx/all_reduce.csv" in fallback.cost_model


def test_a_run_says_which_profile_and_data_its_step_times_rest_on(tmp_path: Path) -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=12, input_len=200, output_len=8, seed=3))
    calibrated = simulate(SimConfig(hardware="a100-80gb", model="llama-3-8b"), trace)
    assert "vidur:a100/meta-llama/Meta-Llama-3-8B" in calibrated.cost_model
    folder = write_sim_run(calibrated, tmp_path / "a100", {"trace": "synthetic"})
    assert json.loads((folder / "config.json").read_text())["cost_model"] == calibrated.cost_model
    roofline = simulate(SimConfig(hardware="h100", model="llama-3-8b"), trace)
    assert "roofline (uncalibrated" in roofline.cost_model


REFUSE_TORCH = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton", "scipy"):
            raise ImportError(name + " imported by a simulation")
sys.meta_path.insert(0, Refuse())
from twinserve.entrypoints.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_calibrated_twin_runs_where_torch_and_scipy_cannot_be_imported(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", REFUSE_TORCH, "simulate", "--num-requests", "30",
                           "--hardware", "a100-80gb", "--model", "llama-3-8b", "--disable-tqdm",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "step times: A100-80GB: fitted to vidur:a100" in proc.stdout
    assert "vidur" in json.loads((tmp_path / "run" / "config.json").read_text())["cost_model"]


# ---- the run folder's fast writer against the plain one -------------------------------------
def test_fast_float_format_equals_the_plain_one() -> None:
    rng = random.Random(5)
    values = [rng.uniform(0, 5000) for _ in range(20000)]
    values += [rng.expovariate(50) for _ in range(20000)]
    values += [rng.random() * 10.0 ** rng.randint(-12, 8) for _ in range(20000)]
    values += [0, 5, 0.0, -0.0, -1.5, 1e-4, 9.99999999e-5, 5e-10, 999999.9999999999, 1e6,
               math.nan, math.inf, 12.5, 3.0]
    assert [run_dir.fmt(v) for v in values] == [run_dir._fmt(v) for v in values]


def test_the_run_folder_writer_equals_its_plain_reference(tmp_path: Path) -> None:
    wl = SyntheticConfig(num_requests=120, input_len=300, output_len=30, range_ratio=0.8,
                         tenant_rates={"a,b": 20.0, "c": 10.0}, seed=4)
    result = simulate(SimConfig(max_num_seqs=16, num_gpu_blocks_override=200), synthetic_trace(wl))
    fast = write_sim_run(result, tmp_path / "fast", {"trace": "synthetic"})
    plain = tmp_path / "plain"
    plain.mkdir()
    with open(plain / "requests.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(run_dir.REQUEST_COLUMNS)
        w.writerows(run_dir._request_row(r) for r in result.records)
    run_dir._write_steps_reference(plain, list(result.steps))
    for name in ("requests.csv", "steps.csv", "tenants.csv"):
        assert (fast / name).read_bytes() == (plain / name).read_bytes(), name
    assert (fast / "tenants.csv").read_text().count('"a,b"') > 5  # quoted where csv quotes


# ---- the GPU calibration path (argument handling here; the measurement in cuda_check.sh) -----
def test_the_bundled_profile_of_a_gpu_is_found_by_its_name() -> None:
    from twinserve.simulator.hardware import bundled_profile_for_device
    assert bundled_profile_for_device("NVIDIA H200") == "h200"
    assert bundled_profile_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert bundled_profile_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert bundled_profile_for_device("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert bundled_profile_for_device("NVIDIA L4") is None


def test_calibrate_on_cuda_without_a_gpu_is_refused_by_name(tmp_path: Path, capsys) -> None:
    import torch

    from twinserve.entrypoints.cli.main import main
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: benchmarks/cuda_check.sh calibrates it")
    rc = main(["calibrate", "--device", "cuda", "--quick", "--out", str(tmp_path / "p.json")])
    assert rc == 2
    assert "device 'cuda': no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_calibration_writes_the_format_the_simulator_loads(tmp_path: Path, datasets) -> None:
    """GPU-shaped steps (Vidur's A100 samples standing for recorded steps) through
    ``calibrate --from-run``, stored under another model name on another base: the profile
    loads, names its source, and a simulation of that model runs on its fit."""
    from twinserve.core.step_sample import SAMPLES_FILE, write_samples
    from twinserve.entrypoints.cli.main import main
    run = tmp_path / "recorded"
    run.mkdir()
    write_samples(run / SAMPLES_FILE, datasets[0].samples)
    out = tmp_path / "h200-calibrated.json"
    rc = main(["calibrate", "--from-run", str(run), "--model", "llama-3-8b", "--profile-model",
               "llama-3.1-8b", "--base-hardware", "h200", "--out", str(out)])
    assert rc == 0
    profile = load_hardware(out)
    params = profile.find_fitted("llama-3.1-8b", 1)
    assert profile.name == "H200-calibrated" and params is not None
    assert params.source.startswith("twinserve calibrate --from-run")
    trace = synthetic_trace(SyntheticConfig(num_requests=8, input_len=100, output_len=5, seed=2))
    result = simulate(SimConfig(hardware=str(out), model="llama-3.1-8b"), trace)
    assert "twinserve calibrate --from-run" in result.cost_model
    assert result.summary["completed"] == 8


def test_the_gpu_grid_reaches_long_chunks_and_contexts_and_the_cpu_grid_is_unchanged() -> None:
    from twinserve.gpu.measurement.profiler import default_grid
    gpu = default_grid(8192, 256, 8192, quick=True, gpu=True)
    assert max(s.num_tokens for s in gpu if s.kind == "prefill") == 8192
    assert max(max(s.decodes) for s in gpu if s.kind == "decode") == 4096
    cpu = default_grid(8192, 256, 8192, quick=True)
    assert max(s.num_tokens for s in cpu if s.kind == "prefill") == 2048
    assert max(max(s.decodes) for s in cpu if s.kind == "decode") == 512
    assert cpu == [s for s in gpu if s.num_tokens <= 2048 and max(s.decodes, default=0) <= 512]


def test_a_bad_base_profile_is_refused_before_anything_is_measured(tmp_path: Path, capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    rc = main(["calibrate", "--model", "llama-3-8b", "--base-hardware", "tpu-v9",
               "--out", str(tmp_path / "p.json")])
    assert rc == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err


def test_the_fitted_step_time_fast_path_equals_its_reference() -> None:
    from twinserve.core.outputs import SchedulerOutput
    cost = make_cost_model(load_model_spec("llama-3-8b"), load_hardware("a100-80gb"))
    assert isinstance(cost, FittedCostModel)
    rng = random.Random(9)
    for _ in range(3000):
        decodes, chunks = rng.randint(0, 256), rng.randint(0, 3)
        prefill = sum(rng.randint(1, 2048) for _ in range(chunks))
        ctx = [rng.randint(2, 8192) for _ in range(decodes)]
        out = SchedulerOutput(
            total_num_scheduled_tokens=decodes + prefill, num_prefill_tokens=prefill,
            num_decode_tokens=decodes, num_prefill_seqs=chunks, num_decode_seqs=decodes,
            sum_context_tokens=sum(ctx) + prefill * rng.randint(1, 4096),
            sum_decode_context_tokens=sum(ctx), max_decode_context=max(ctx, default=0))
        assert cost.step_time(out) == cost.step_time_reference(out)
    swap = SchedulerOutput(total_num_scheduled_tokens=4, num_decode_tokens=4, num_decode_seqs=4,
                           sum_context_tokens=400, sum_decode_context_tokens=400,
                           max_decode_context=100, blocks_to_swap_out=[(1, 2)])
    assert cost.step_time(swap) == cost.step_time_reference(swap) > cost.step_time_reference(
        SchedulerOutput(total_num_scheduled_tokens=4, num_decode_tokens=4, num_decode_seqs=4,
                        sum_context_tokens=400, sum_decode_context_tokens=400,
                        max_decode_context=100))


def test_the_report_has_a_row_per_profile_tp_and_band(datasets) -> None:
    from twinserve.benchmarks.gpu_profiles import roofline_attention_gap, step_table, summary_table
    from twinserve.simulator.vidur_network import SIZE_BANDS, band_label
    from twinserve.simulator.vidur_profiles import format_all_reduce
    fits = [(d, load_hardware(d.dataset.hardware).find_fitted(d.dataset.models[0], d.tensor_parallel_size))
            for d in datasets]
    rows = summary_table(fits).splitlines()[2:]
    assert len(rows) == len(datasets)
    for row, (data, params) in zip(rows, fits):
        cells = row.split()
        assert cells[:3] == [data.dataset.hardware, params.model, str(data.tensor_parallel_size)]
        assert cells[-1] == ("measured" if data.dataset.measured_attention(data.tensor_parallel_size)
                             else "roofline")
        assert f"{params.fit_error['all_mape']:.1f}" in row
    table = step_table(next(d for d in datasets if d.tensor_parallel_size == 2)).splitlines()
    assert "roofline attention" in table[0] and len(table) >= 8
    gap = roofline_attention_gap(datasets[0]).splitlines()
    assert [line.split()[0] for line in gap[2:]] == ["decode", "prefill", "mixed"]
    assert all(float(line.split()[2]) < 0 for line in gap[2:])  # the roofline's attention is short
    text = format_all_reduce("h100_dgx")
    for band in SIZE_BANDS:
        assert f"  {band_label(band):<10} {8:>5} " in text
