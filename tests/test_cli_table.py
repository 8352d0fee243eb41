"""The command line as a table of commands (issue 22 item 5): the parser built from the table has
exactly the subcommands, flags, help texts, defaults and choices the hand-written parser had.

``tests/data/cli_parser_before_issue22.json`` was written by :func:`parser_structure` from the parser
of ``git show main:expstream/cli.py`` before the table replaced it (the default of ``stage
--replica-id`` is machine-dependent and left out); it is the reference, not something this code made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE = Path(__file__).parent / "data" / "cli_parser_before_issue22.json"
MACHINE_DEPENDENT_DEFAULTS = {("stage", "replica_id")}
#: Subcommands added since issue 22, after the ones of BEFORE (each has its own tests): `k8s` (issue 25),
#: `feed` (issue 25's follow-up: tests/test_feed.py).
ADDED_SINCE = ("k8s", "feed")
#: Arguments whose help text changed since issue 22 (command, dest): `stage NAME` also names a chain (issue 28).
HELP_CHANGED_SINCE = {("stage", "name")}
#: Options added since to a subcommand of BEFORE (each has its own tests): `stage --assign` (issue 28,
#: tests/test_assigning.py).
ARGS_ADDED_SINCE = {("stage", "assign")}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def parser_structure(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Any]:
    """Every (sub)parser of ``parser`` by its command path, with each argument's option strings,
    dest, help, default, choices, nargs, metavar, required flag and action type."""
    out: dict[str, Any] = {path or "expstream": {"description": parser.description, "arguments": []}}
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            out[path or "expstream"]["subcommands"] = {name: helps.get(name) for name in action.choices}
            for name, sub in action.choices.items():
                out.update(parser_structure(sub, f"{path} {name}".strip()))
            continue
        default = action.default
        if (path, action.dest) in MACHINE_DEPENDENT_DEFAULTS:
            default = "<machine>"
        out[path or "expstream"]["arguments"].append({
            "options": list(action.option_strings), "dest": action.dest, "help": action.help,
            "default": _jsonable(default), "choices": _jsonable(action.choices), "nargs": _jsonable(action.nargs),
            "metavar": _jsonable(action.metavar), "required": action.required, "action": type(action).__name__,
        })
    return out


def test_the_table_builds_the_same_parser_as_before():
    from expstream.cli import build_parser

    before = json.loads(BEFORE.read_text())
    now = json.loads(json.dumps(parser_structure(build_parser())))
    now = {path: v for path, v in now.items() if path.split()[0] not in ADDED_SINCE}
    subcommands = list(now["expstream"]["subcommands"].items())
    assert [name for name, _ in subcommands[len(before["expstream"]["subcommands"]):]] == list(ADDED_SINCE)
    now["expstream"]["subcommands"] = dict(subcommands[:len(before["expstream"]["subcommands"])])
    assert sorted(now) == sorted(before), "subcommands differ"
    assert list(now["expstream"]["subcommands"].items()) == list(before["expstream"]["subcommands"].items())
    for command in before:
        now[command]["arguments"] = [a for a in now[command]["arguments"] if (command, a["dest"]) not in ARGS_ADDED_SINCE]
        for args in (now[command]["arguments"], before[command]["arguments"]):
            for arg in args:
                if (command, arg["dest"]) in HELP_CHANGED_SINCE:
                    arg["help"] = "<changed since>"
        assert now[command] == before[command], f"`expstream {command}` differs"


def test_each_subcommand_help_exits_0_and_lists_its_flags():
    before = json.loads(BEFORE.read_text())
    env = {**os.environ, "COLUMNS": "200"}
    top = subprocess.run([sys.executable, "-m", "expstream", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    for name in before["expstream"]["subcommands"]:
        assert name in top.stdout
    proc = subprocess.run([sys.executable, "-m", "expstream", "replay", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for arg in before["replay"]["arguments"]:
        for option in arg["options"]:
            assert option in proc.stdout


def test_the_cli_is_a_table_of_commands_each_module_contributes():
    import inspect

    from expstream.cli import COMMANDS

    before = json.loads(BEFORE.read_text())
    assert [c.name for c in COMMANDS] == [*before["expstream"]["subcommands"], *ADDED_SINCE]
    for command in COMMANDS:
        # one parser argument, no helper handed in; the entry function takes (args) or (topo, args) only
        assert list(inspect.signature(command.add_arguments).parameters) == [next(iter(
            inspect.signature(command.add_arguments).parameters))], command.name
        expected = ["topo", "args"] if command.reads_topology else ["args"]
        assert list(inspect.signature(command.run).parameters)[:len(expected)] == expected, command.name
        required = [p for p in inspect.signature(command.run).parameters.values() if p.default is inspect.Parameter.empty]
        assert len(required) == len(expected), f"{command.name}: run() wants more than {expected}"


#: Issue 22's "no function over 80 lines", for the command line and the command functions it split.
SPLIT_MODULES = ("expstream/cli.py", "expstream/config/cli_args.py", "expstream/config/kafka.py",
                 "expstream/kafka/topics.py", "expstream/launch/commands.py", "expstream/tools/status.py",
                 "expstream/tools/recorder.py", "expstream/tools/replaybroker.py", "expstream/tools/replay_command.py")


def test_no_function_over_80_lines_in_the_cli_and_the_split_commands():
    import ast

    long = []
    for rel in SPLIT_MODULES:
        path = ROOT / rel
        if not path.exists():
            long.append(f"{rel}: missing")
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
