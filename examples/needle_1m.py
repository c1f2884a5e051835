"""The 1M-token demo from Python. SYNTHETIC: Gaussian KV shaped like one Llama-3.1-8B layer with planted
needle entries (no model runs; no machine here could prefill 1M tokens); recall has to find each needle.

    python examples/needle_1m.py [--short] [--device cpu|cuda|cuda:N]
"""

import argparse

import torch

from kvtier.bench.synthetic import synthetic_needles
from kvtier.cli.format import human_bytes

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--short", action="store_true", help="a small run, in seconds")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the device tier and recall run (default: cuda when there is one, else cpu)")
args = parser.parse_args()
context = 65_536 if args.short else 1_048_576
report = synthetic_needles("llama-3.1-8b", context=context, needles=3, device_budget=0.01, host_budget=0.05,
                           device=args.device)
for needle in report["needles"]:
    print(f"needle at {needle['position']:,}: recalled={needle['recalled']}, "
          f"cosine to its value {needle['cosine_to_needle_value']:.4f}")
for tier in ("device", "host", "disk"):
    print(f"{tier}: {human_bytes(report['usage'][tier]['bytes'])}")
if not all(n["recalled"] for n in report["needles"]):   # a check, not an assert (python -O drops those)
    raise SystemExit("a needle was not recalled")
