"""The `kvtier` command line (click). Each command parses its options and delegates.

Every failure prints one line, ``kvtier: error: <message>``, and exits 2 for a mistake in what was asked or 3
for a failure while running; with ``--json`` a JSON object ``{"error": ..., "exit_code": N}`` is printed on
stdout as well (see `common`).
"""

from __future__ import annotations

from typing import Any

import click

from .bench import bench
from .chat import chat
from .common import run_main
from .demo import demo
from .evaluate import evaluate, report
from .info import info
from .kvp import calibrate, eval_scorer, traces, train


class KVTierGroup(click.Group):
    """A click group whose errors (click's usage errors included) are one line, not a usage block."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:  # embedded use: click's own behaviour (exceptions propagate)
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        run_main(super().main, None if args is None else list(args), prog_name=prog_name,
                 complete_var=complete_var, **extra)


@click.group(cls=KVTierGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: a KV-cache memory hierarchy (GPU, host memory, disk) for long-context inference."""


main.add_command(demo)
main.add_command(chat)
main.add_command(info)
main.add_command(bench)
main.add_command(traces)
main.add_command(train)
main.add_command(calibrate)
main.add_command(eval_scorer)
main.add_command(evaluate)
main.add_command(report)
