"""The `kvtier` command line (click). Each command parses its options and delegates."""

from __future__ import annotations

import click

from .bench import bench
from .chat import chat
from .demo import demo
from .evaluate import evaluate, report
from .info import info
from .kvp import eval_scorer, traces, train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: a KV-cache memory hierarchy (GPU, host memory, disk) for long-context inference."""


main.add_command(demo)
main.add_command(chat)
main.add_command(info)
main.add_command(bench)
main.add_command(traces)
main.add_command(train)
main.add_command(eval_scorer)
main.add_command(evaluate)
main.add_command(report)
