"""The ``expstream`` program: ``python -m expstream`` and the console script (pyproject.toml) both call
:func:`main`.

``expstream run`` starts its fork server first (expstream.launch.commands.start_fork_server_early),
before the command line's own imports (every subcommand's module, kafka-python, redis: 0.5-2 s), so
that the server's seconds of torch imports, the longest step before a stage can start, overlap them.
"""

import sys


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        from expstream.launch.commands import start_fork_server_early

        start_fork_server_early(sys.argv[2:])
    from expstream.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
