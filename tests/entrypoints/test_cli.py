"""The twinserve command line: simulate, report, errors."""

import json

import pytest

from twinserve.entrypoints.cli.main import main
from twinserve.gpu.worker.cpu_cores import usable_cores


def test_simulate_writes_a_run_folder_and_report(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--trace", "azure-conv", "--num-requests", "50", "--model", "llama-3-8b",
               "--hardware", "a100-80gb", "--policy", "fair", "--tenants", "heavy=3,light=1",
               "--max-num-seqs", "32", "--out", str(out), "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "Mean TTFT (ms):" in text
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["completed"] == 50 and config["scheduling_policy"] == "fair"
    assert config["max_num_seqs"] == 32 and config["backend"] == "sim"
    assert set(summary["tenant_service"]) == {"heavy", "light"}
    rc = main(["report", str(out), "--out", str(tmp_path / "r.html"), "--goodput", "ttft:500"])
    assert rc == 0 and (tmp_path / "r.html").stat().st_size > 100_000


def test_bad_names_exit_2_with_the_valid_ones(capsys):
    assert main(["simulate", "--num-requests", "5", "--policy", "nope"]) == 2
    assert "valid: fair, fcfs, lora_affinity, priority, sjf, static" in capsys.readouterr().err
    assert main(["simulate", "--num-requests", "5", "--hardware", "tpu"]) == 2
    assert "h100-sxm" in capsys.readouterr().err
    assert main(["simulate", "--num-requests", "5", "--model", "gpt-9"]) == 2
    assert "llama-3-8b" in capsys.readouterr().err
    assert main(["report", "/nonexistent/run"]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_demo_tells_policies_and_the_twin_against_three_real_replays_apart(tmp_path, monkeypatch,
                                                                             capsys):
    # validate's real replays are stood in for by copies of a simulated run, marked real (the
    # wiring is under test: validate gets the repeats, the twin page every real replay and both
    # twins, the policy page the simulated policies alone)
    import shutil
    from types import SimpleNamespace

    from twinserve.fidelity import validation

    seen = {}
    demo = tmp_path / "demo"
    folder = demo / "real-vs-sim"

    def copy_sim(to, backend: str = "sim") -> None:
        shutil.copytree(demo / "sim-fcfs", to, dirs_exist_ok=True)
        config = json.loads((to / "config.json").read_text())
        config.update(backend=backend, device_type="cpu")
        (to / "config.json").write_text(json.dumps(config))

    def fake_validate(engine, workload, out, settings, progress=None):
        table = SimpleNamespace(format=lambda: "")
        if settings.reuse_real:  # then the same twin at the replays' own speed
            seen.update(again=([str(d) for d in settings.reuse_real], settings.profile,
                               settings.at_speed, len(workload.requests)))
            copy_sim(out / "sim")
            return SimpleNamespace(table=table, twin_run=out / "sim")
        seen.update(repeats=settings.real_repeats, num_requests=len(workload.requests),
                    threads=settings.calibration.num_threads)
        reals = tuple(out / name for name in ("real", "real-2", "real-3"))
        for real in reals:
            copy_sim(real, "twinserve")
        copy_sim(out / "sim")
        return SimpleNamespace(table=table, twin_run=out / "sim", real_runs=reals,
                               profile=out / "profile.json", profile_source="calibrated")

    monkeypatch.setattr(validation, "validate", fake_validate)
    rc = main(["demo", "--num-requests", "40", "--real-requests", "4", "--out", str(demo)])
    reals = [str(folder / name) for name in ("real", "real-2", "real-3")]
    # the real engine runs on every core but one (vLLM's CPU backend reserves one for the host)
    threads = max(1, usable_cores() - 1)
    assert rc == 0 and seen == {"repeats": 3, "num_requests": 4, "threads": threads,
                                "again": (reals, str(folder / "profile.json"), "replay", 4)}
    printed = capsys.readouterr().out
    assert "step times: A100-80GB: fitted to vidur:a100" in printed
    assert all(f"sim a100-80gb {p}" in printed for p in ("fcfs", "priority", "fair"))
    assert "(priority 0: " in printed and ", light tenant: " in printed
    assert "twin cpu fcfs: 6 of 6 targeted metrics within target" in printed
    assert f"report: {demo / 'report.html'} (the index of {demo / 'policies.html'} and" in printed
    index = (demo / "report.html").read_text()
    assert 'href="policies.html"' in index and 'href="twin-vs-real.html"' in index
    policies = (demo / "policies.html").read_text()
    twin = (demo / "twin-vs-real.html").read_text()
    for policy in ("fcfs", "priority", "fair"):
        assert f">sim a100-80gb {policy}<" in policies and f">{demo / f'sim-{policy}'}<" in policies
        assert f"sim a100-80gb {policy}" not in twin
    assert "real-vs-sim" not in policies
    twin_dirs = [*reals, str(folder / "sim"), str(folder / "at-replay-speed" / "sim")]
    assert all(f">{d}<" in twin for d in twin_dirs)
    names = ["real cpu fcfs #1", "real cpu fcfs #2", "real cpu fcfs #3", "twin cpu fcfs",
             "twin cpu fcfs (at the replays&#x27; speed)"]
    assert all(f">{name}<" in twin for name in names)
    # the copies are one run: the twin meets their median exactly, every metric within target
    assert "twin cpu fcfs: 6 of 6 targeted metrics within target" in index and "1 missed" not in index
    assert main(["demo", "--num-requests", "40", "--real-requests", "4", "--threads", "3",
                 "--out", str(demo)]) == 0 and seen["threads"] == 3
    with pytest.raises(SystemExit):
        main(["demo", "--threads", "0", "--out", str(demo)])
    assert "--threads: must be an integer >= 1, got 0" in capsys.readouterr().err
