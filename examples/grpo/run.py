"""Run the GRPO example: ``python examples/grpo/run.py [--steps 300] [--device cuda
--shape large] [--no-aligned]``. Prints one line per step (mean reward, the
rollout-vs-trainer logprob gap, rollout/train/push times) and a summary of the reward
curve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the `grpo` package

from grpo.loop import Settings, run  # noqa: E402
from grpo.policy import SHAPES  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, train, print the reward curve in windows of 10% of the run."""
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__)
    for field, kind in (("steps", int), ("prompts_per_step", int), ("group_size", int),
                        ("length", int), ("lr", float), ("seed", int), ("bucket_bytes", int),
                        ("threads", int)):
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind,
                            default=getattr(defaults, field))
    parser.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=defaults.shape)
    parser.add_argument("--engine-dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        default=defaults.engine_dtype)
    parser.add_argument("--aligned", action=argparse.BooleanOptionalAction,
                        default=defaults.aligned,
                        help="a deterministic engine and the trainer on its kernels "
                             "(kvrunner.aligned): a logprob gap of exactly 0")
    args = vars(parser.parse_args(argv))
    records = run(Settings(**args))
    window = max(1, len(records) // 10)
    curve = [sum(r.mean_reward for r in records[i : i + window]) / len(records[i : i + window])
             for i in range(0, len(records), window)]
    print("reward by tenth of the run:", " ".join(f"{r:.2f}" for r in curve))
    print(f"logprob gap over the run: mean {sum(r.gap_mean for r in records) / len(records):.2e}"
          f", max {max(r.gap_max for r in records):.2e}")


if __name__ == "__main__":
    main()
