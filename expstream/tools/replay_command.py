"""The ``expstream replay`` command: its arguments, and the dispatch between an in-process replay
(expstream/tools/replay.py), a replay through a broker (expstream/tools/replaybroker.py) and a
re-publish into a live topic (``--into``). It lives apart from both so that it can import both
(replaybroker imports replay). docs/replay.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.topology import load_topology
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError, ExpstreamError
from expstream.tools.replay import (
    DEFAULT_OUTPUT_PREFIX,
    Filters,
    recorded_topology_path,
    replay_run,
    republish,
)
from expstream.tools.replaybroker import broker_replay
from expstream.tools.replayinput import parse_ids, parse_offsets


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """The ``replay`` subcommand's arguments."""
    add_topology_args(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with a recording (runs/<name>)")
    p.add_argument("--from", dest="from_topic", required=True, metavar="TOPIC",
                   help="the recorded topic to read, e.g. scored")
    p.add_argument("--stages", help="one stage, or a span A..B of enabled stages; the first must read --from")
    p.add_argument("--output", help=f"the new run directory (default {DEFAULT_OUTPUT_PREFIX}<time>-<tag>)")
    p.add_argument("--samples", help="sample ids group#index, comma separated: only those rows")
    p.add_argument("--groups", help="group (prompt) ids, comma separated: only those rows")
    p.add_argument("--batches", help="batch ids, comma separated: only those records")
    p.add_argument("--offsets", help="partition:first-last[,...]: only those records, e.g. 0:12-40,1:0-9")
    p.add_argument("--into", metavar="TOPIC",
                   help="re-publish the selected records into this live topic (needs --bootstrap-servers)")
    p.add_argument("--keep-ids", action="store_true", help="with --into: keep batch/prompt/group ids as recorded")
    p.add_argument("--tag", help="with --into: the namespace replay-<tag>/ (default: the time)")


def replay_command(args: argparse.Namespace) -> int:
    """``expstream replay``: dispatch to :func:`replay_run` (in process), :func:`broker_replay` (with
    ``--bootstrap-servers``) or :func:`republish` (with ``--into``); prints a short report."""
    filters = Filters(samples=parse_ids(args.samples, "--samples"), groups=parse_ids(args.groups, "--groups"),
                      batches=parse_ids(args.batches, "--batches"), offsets=parse_offsets(args.offsets))
    if args.into:
        if not args.bootstrap_servers:
            raise ConfigError("--into needs the live pipeline's broker", field="--bootstrap-servers",
                              fix="add --bootstrap-servers HOST:PORT")
        if args.stages:
            raise ConfigError("--into re-publishes records as recorded; it runs no stages", field="--stages",
                              fix="leave --stages out (the live pipeline's stages process them)")
        topo = load_topology(Path(args.topology) if args.topology else recorded_topology_path(args.run_dir),
                             args.overrides)
        from expstream.launch.preflight import KAFKA_FIX_EXISTING, check_kafka

        # an unreachable broker: one line in seconds, not a traceback after a 30 s bootstrap timeout
        check_kafka(args.bootstrap_servers, topo.kafka, fix=KAFKA_FIX_EXISTING)
        report = republish(args.run_dir, args.from_topic, args.into, args.bootstrap_servers, filters=filters,
                           keep_ids=args.keep_ids, tag=args.tag, kafka_cfg=topo.kafka)
        print(f"expstream replay: sent {report['sent']} records of {args.from_topic} to {args.into} "
              f"({'ids kept' if args.keep_ids else 'ids under ' + report['namespace']})")
        return EXIT_OK
    if args.keep_ids or args.tag:
        raise ConfigError("--keep-ids and --tag go with --into", field="--keep-ids" if args.keep_ids else "--tag",
                          fix="add --into TOPIC --bootstrap-servers B, or leave them out")
    if not args.stages:
        raise ConfigError("which stages to replay?", field="--stages",
                          fix="add --stages NAME or --stages A..B (the first reads --from)")
    try:
        if args.bootstrap_servers:
            summary = broker_replay(args.run_dir, args.from_topic, args.stages, args.bootstrap_servers,
                                    redis_url=args.redis_url, overrides=args.overrides, output=args.output,
                                    filters=filters, topology=args.topology)
        else:
            summary = replay_run(args.run_dir, args.from_topic, args.stages, overrides=args.overrides,
                                 output=args.output, filters=filters, topology=args.topology)
    except ExpstreamError as exc:
        if isinstance(exc, ConfigError):
            raise
        print(f"expstream replay: {exc}", file=sys.stderr)
        return EXIT_FAILED
    span = "..".join(dict.fromkeys([summary["span"][0], summary["span"][-1]]))
    if summary["via"] == "broker":
        print(f"expstream replay: {summary['records_in']} of {summary['records_read']} records of {args.from_topic} "
              f"through {span} on {summary['bootstrap_servers']}: {summary['samples_out']} of "
              f"{summary['samples_in']} samples out, {summary['dead_letters']} dead letters; {summary['status']}")
        print(f"  wrote {summary['output']}: records per topic[partition] " + json.dumps(summary["records_out"]))
        if summary["status"] != "ok":
            print(f"expstream replay: failed: {summary['error']}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    stages = ", ".join(f"{n} {s['batches']} batches {s['ms_per_batch']} ms/batch" for n, s in summary["stages"].items())
    print(f"expstream replay: {summary['records_in']} of {summary['records_read']} records of {args.from_topic} "
          f"through {'..'.join(dict.fromkeys([summary['span'][0], summary['span'][-1]]))}: {stages}; "
          f"{summary['dead_letters']} dead letters, {summary['records_undecodable']} undecodable")
    print(f"  wrote {summary['output']}: records per topic[partition] " + json.dumps(summary["records_out"]))
    return EXIT_OK


REPLAY = Command("replay", "run recorded records through a stage span again (docs/replay.md)", add_replay_arguments,
                 replay_command, reads_topology=False,
                 description="Without --bootstrap-servers the span runs in this process (no broker is "
                             "started); with it, as stage processes through that broker on fresh replay-<tag>. "
                             "topics; with --into, the records are re-published into a live topic instead.")
