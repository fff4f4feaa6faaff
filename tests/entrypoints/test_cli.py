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


def test_demo_compares_the_twin_with_three_real_replays(tmp_path, monkeypatch, capsys):
    # validate's real replays are stood in for by copies of a simulated run (the wiring is under
    # test: validate gets the repeats, the report every real replay and the twin)
    import shutil

    from twinserve.entrypoints.cli import validate

    seen = {}
    folder = tmp_path / "demo" / "real-vs-sim"

    def fake_validate(args) -> int:
        if args.reuse_real:  # then the same twin at the replays' own speed
            seen.update(again=(args.reuse_real, args.profile, args.at_replay_speed,
                               args.num_requests))
            return 0
        seen.update(repeats=args.real_repeats, num_requests=args.num_requests,
                    threads=args.threads)
        for name in ("real", "real-2", "real-3", "sim"):
            shutil.copytree(tmp_path / "demo" / "sim-fcfs", folder / name, dirs_exist_ok=True)
        return 0

    monkeypatch.setattr(validate, "run_validate", fake_validate)
    rc = main(["demo", "--num-requests", "40", "--real-requests", "4", "--out",
               str(tmp_path / "demo")])
    reals = [str(folder / name) for name in ("real", "real-2", "real-3")]
    # the real engine runs on every core but one (vLLM's CPU backend reserves one for the host)
    threads = max(1, usable_cores() - 1)
    assert rc == 0 and seen == {"repeats": 3, "num_requests": 4, "threads": threads,
                                "again": (reals, str(folder / "profile.json"), True, 4)}
    html = (tmp_path / "demo" / "report.html").read_text()
    assert all(f">{folder / name}<" in html for name in ("real", "real-2", "real-3", "sim"))
    assert main(["demo", "--num-requests", "40", "--real-requests", "4", "--threads", "3",
                 "--out", str(tmp_path / "demo")]) == 0 and seen["threads"] == 3
    with pytest.raises(SystemExit):
        main(["demo", "--threads", "0", "--out", str(tmp_path / "demo")])
    assert "--threads: must be an integer >= 1, got 0" in capsys.readouterr().err
