"""The grammar masks' time per step on this machine, as ``twinserve calibrate`` measures it for
the twin (``gpu/measurement/structured_mask_profile.py``): batches of 1..N constrained rows on the bundled
model's vocabulary, several rounds, the fitted per-row and per-step terms of each and their
medians.

    python -m twinserve.benchmarks.structured_mask_time [--rows 1 8 32 64] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: bundled)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from pathlib import Path

    from twinserve.gpu.engine.tokenizer import Tokenizer
    from twinserve.gpu.measurement.structured_mask_profile import measure_mask_time
    from twinserve.gpu.models.default_model import resolve_model_path
    model_dir = Path(resolve_model_path(args.model))
    tokenizer = Tokenizer.from_dir(model_dir)
    if tokenizer.eos_token_id is None:
        raise SystemExit("the model has no EOS token: no constrained decoding")
    per_row, per_step = [], []
    for r in range(args.rounds):
        timing = measure_mask_time(model_dir / "tokenizer.json", tokenizer.vocab_size,
                                   tokenizer.eos_token_id, rows=args.rows, steps=args.steps,
                                   seed=r)
        per_row.append(timing.per_row_s)
        per_step.append(timing.per_step_s)
        medians = ", ".join(f"{n} rows {s * 1e3:.2f} ms" for n, s in zip(timing.rows,
                                                                         timing.median_s))
        print(f"round {r + 1}: {medians}; fit {timing.per_row_s * 1e3:.3f} ms/row + "
              f"{timing.per_step_s * 1e3:.3f} ms/step")
    print(f"median of {args.rounds} rounds: {statistics.median(per_row) * 1e3:.3f} ms per "
          f"constrained row + {statistics.median(per_step) * 1e3:.3f} ms per step "
          f"(vocabulary {tokenizer.vocab_size})")


if __name__ == "__main__":
    main()
