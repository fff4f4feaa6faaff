"""benchmarks/offline_throughput.py: the engines take turns on the CPU, and each ratio pairs the
passes of one round."""

from collections import Counter

import pytest

from twinserve.benchmarks.offline_throughput import Engines, measure, schedule, summary


def test_interleaved_rounds_run_every_pass_once_and_rotate_the_engines():
    passes = schedule(["twinserve", "hf", "vllm"], ["batch", "single"], 3, interleave=True)
    assert Counter(passes) == Counter((r, e, w) for r in range(3) for e in ["twinserve", "hf", "vllm"]
                                      for w in ["batch", "single"])
    assert [r for r, _, _ in passes] == sorted(r for r, _, _ in passes)  # round by round
    firsts = [next(e for r2, e, _ in passes if r2 == r) for r in range(3)]
    assert firsts == ["twinserve", "hf", "vllm"]


def test_sequential_schedule_runs_each_engine_to_the_end_before_the_next():
    passes = schedule(["twinserve", "hf"], ["batch", "single"], 2, interleave=False)
    engines = [e for _, e, _ in passes]
    assert engines == ["twinserve"] * 6 + ["hf"] * 6
    # each engine's workload starts with an untimed warm-up round (-1)
    assert [r for r, e, w in passes if (e, w) == ("hf", "batch")] == [-1, 0, 1]


class FakeEngines:
    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.events: list[str] = []

    def run(self, engine, prompts, lengths):
        self.loaded.add(engine)
        self.events.append(f"run {engine} with {sorted(self.loaded)}")
        return {"twinserve": 100.0, "hf": 50.0}[engine] * len(lengths)

    def close(self, engine):
        self.loaded.discard(engine)
        self.events.append(f"close {engine}")

    def close_all(self):
        for engine in sorted(self.loaded):
            self.close(engine)


def test_sequential_measure_holds_one_engine_at_a_time():
    fake = FakeEngines()
    data = {"batch": ([[1]] * 2, [4, 4]), "single": ([[1]], [4])}
    results = measure(fake, ["twinserve", "hf"], data, 2, interleave=False)
    assert results == {"twinserve": {"batch": [200.0, 200.0], "single": [100.0, 100.0]},
                       "hf": {"batch": [100.0, 100.0], "single": [50.0, 50.0]}}
    assert sum(e.startswith("run twinserve") for e in fake.events) == 6  # 2 warm-ups, untimed
    assert all("'hf', 'twinserve'" not in e for e in fake.events)
    assert fake.events.index("close twinserve") < fake.events.index("run hf with ['hf']")
    assert fake.loaded == set()


def test_interleaved_measure_keeps_every_engine_loaded_until_the_end():
    fake = FakeEngines()
    measure(fake, ["twinserve", "hf"], {"batch": ([[1]], [4])}, 2, interleave=True)
    assert fake.events[:4] == ["run twinserve with ['twinserve']", "run hf with ['hf', 'twinserve']",
                               "run hf with ['hf', 'twinserve']", "run twinserve with ['hf', 'twinserve']"]
    assert fake.loaded == set()


def test_summary_takes_the_median_of_per_round_ratios():
    # rounds 10/10, 20/5, 30/30: ratios 1, 4, 1 -> 1.00 (the ratio of the medians would be 2.00)
    text = summary({"twinserve": {"batch": [10.0, 20.0, 30.0]},
                    "hf": {"batch": [10.0, 5.0, 30.0]}})
    header, row, runs = text.splitlines()
    assert header.split() == ["workload", "twinserve", "tok/s", "hf", "tok/s", "twinserve/hf"]
    assert row.split() == ["batch", "20.0", "10.0", "1.00"]
    assert runs.startswith("runs: ")


def test_real_engines_generate_the_workload_and_a_missing_vllm_venv_is_named(tiny_model_dirs,
                                                                              tmp_path):
    engines = Engines(str(tiny_model_dirs["qwen2-tied"]), "float32", "cpu", False, None, tmp_path)
    prompts, lengths = [[5, 6, 7, 8], [9, 10, 11, 12]], [6, 3]
    data = {"tiny": (prompts, lengths)}
    results = measure(engines, ["twinserve", "hf"], data, 2, interleave=True)
    assert all(len(r["tiny"]) == 2 and min(r["tiny"]) > 0 for r in results.values())
    with pytest.raises(ValueError, match="vllm_python"):
        engines.run("vllm", prompts, lengths)
