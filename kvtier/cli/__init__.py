"""The `kvtier` command line (click). Each command parses its options and delegates."""

from __future__ import annotations

import click

from .bench import bench
from .demo import demo


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: a KV-cache memory hierarchy (GPU, host memory, disk) for long-context inference."""


main.add_command(demo)
main.add_command(bench)
