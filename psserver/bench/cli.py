"""`ps-bench`: measure communication and end-to-end training on your own machine.

The group is here; `comm` in psserver.bench.commcli, `train` in psserver.bench.traincli,
`straggler` and `link` in psserver.bench.scenarios.

What this is not: part of the product. ps-server and ps-worker never import psserver.bench
(tests/test_layout.py checks); it starts them as ps-local does, through common.roles."""

import click

from common.cli import ENV_PREFIX, EnvAwareGroup, unwinding_on_termination
from common.startup import freeze_imported_objects
from psserver.bench.commcli import comm
from psserver.bench.scenarios import link, straggler
from psserver.bench.traincli import train


@click.group(cls=EnvAwareGroup, context_settings={"show_default": True, "max_content_width": 100})
def command() -> None:
    """Benchmarks that print a markdown table and can write JSON and a PNG plot."""


command.add_command(comm)
command.add_command(train)
command.add_command(straggler)
command.add_command(link)


def main() -> None:
    freeze_imported_objects()
    with unwinding_on_termination():
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
