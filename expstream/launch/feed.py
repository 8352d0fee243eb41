"""``expstream feed``: a prompt file into the input topic of a pipeline that runs elsewhere.

``expstream run`` feeds only the pipeline it starts itself. On Kubernetes (docs/deploy.md
"Kubernetes") the stages run as Deployments and nothing feeds them: this command does, once per
epoch, as a Job or a ``kubectl run``. It reads the prompt file exactly as ``expstream run`` does
(:func:`expstream.launch.run.read_run_prompts`: the same checks, the media root's confinement, a bad
file a ConfigError, exit 2, before anything is sent), stores the images and videos in
``run.blob_store``, dead-letters the rows whose media were refused and publishes the others to the
topology's input topic, every send confirmed.

Ids (the stages dedupe by batch id and by group id, so a second feed must not reuse them): epoch
``N`` (``--epoch N``, default 0) is the continuous loop's epoch N (expstream/launch/prompts.py): the
prompts in the permutation seeded by ``(run.seed, N)``, prompt ids ``<id>@e<N>``, and batch ids
``p{k:06d}@e<N>`` (k from 0 in each epoch). Two epochs never share an id. Feeding the *same* epoch
twice sends the same records with the same ids (the same order, the same batch split): the stages
treat them as a redelivery (generate regenerates them, every later stage and the trainer dedupe by
batch and sample id), so a feed Job that died half way is simply run again. Nothing is kept in Redis
for it, so the command needs only the broker.
"""

from __future__ import annotations

import argparse
import logging

from expstream.config.cli_args import Command
from expstream.config.topology import Topology
from expstream.errors import EXIT_OK, ConfigError

log = logging.getLogger("expstream.feed")

#: The batch ids of epoch N end with this (``p000003@e2``): the prompt ids' separator.
BATCH_EPOCH_FORMAT = "@e{epoch}"


def add_feed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="JSON-lines prompt file (the format of `expstream run --prompts`)")
    p.add_argument("--bootstrap-servers", required=True, help="Kafka HOST:PORT of the running pipeline")
    p.add_argument("--run-id", required=True, help="the run being fed (named in the output and the log)")
    p.add_argument("--topology", help="topology YAML (default: ./topology.yaml when present, else the packaged copy)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="override a topology value; repeatable")
    p.add_argument("--media-root", metavar="DIR",
                   help="image/video paths of the prompt file must resolve inside DIR (default: the prompt file's "
                        "directory; = --set run.media_root=DIR; docs/vision.md)")
    p.add_argument("--epoch", type=int, default=0, metavar="N",
                   help="epoch number: prompt ids <id>@eN, batch ids p000000@eN, order shuffled by (run.seed, N); "
                        "feed each epoch once with its own N (the same N again is a harmless redelivery)")


def epoch_rows(rows: list, seed: int, epoch: int) -> list:
    """``rows`` in epoch ``epoch``'s order with its prompt ids (the continuous loop's epoch, whole)."""
    from expstream.launch.prompts import PromptRow, epoch_order, epoch_prompt_id

    return [PromptRow(epoch_prompt_id(r.prompt_id, epoch), r.prompt, r.label, r.reference, r.images, r.videos,
                      source=r.source, refused=r.refused, media_checked=r.media_checked)
            for r in (rows[i] for i in epoch_order(len(rows), seed, epoch))]


def _check_topic(bootstrap: str, topo: Topology) -> None:
    from expstream.kafka.clients import make_admin

    admin = make_admin(bootstrap, topo.kafka)
    try:
        topics = set(admin.list_topics())
    finally:
        admin.close()
    if topo.topics.input not in topics:
        raise ConfigError(f"the input topic {topo.topics.input!r} does not exist at {bootstrap}",
                          field="topics.input", fix="create the pipeline's topics first (`expstream topics create`, "
                          "or the KafkaTopics of `expstream k8s render`), with the same topology")


def feed_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream feed``: one epoch of the prompt file into the input topic; one line, exit 0."""
    from expstream.launch.preflight import check_kafka
    from expstream.launch.prompts import feed_prompts, has_media, store_media
    from expstream.launch.run import read_run_prompts
    from expstream.models.media import MIB

    if args.epoch < 0:
        raise ConfigError(f"--epoch {args.epoch}: an epoch is a number >= 0", field="--epoch",
                          fix="give 0 for the first feed, 1 for the second, ...")
    rows = epoch_rows(read_run_prompts(topo, args), topo.run.seed, args.epoch)
    if has_media(rows) and not topo.run.blob_store:
        raise ConfigError("the prompts have images or videos but run.blob_store is not set", field="run.blob_store",
                          fix="give the store the stages read, e.g. --set run.blob_store=/shared/blobs")
    check_kafka(args.bootstrap_servers, topo.kafka)
    _check_topic(args.bootstrap_servers, topo)
    if has_media(rows):
        from expstream.models.blobs import open_blob_store

        stored = store_media(rows, open_blob_store(topo.run.blob_store or ""),
                             max_bytes=int(topo.run.media_max_mb * MIB))
        log.info("feed %s: %d images/videos stored in %s", args.run_id, stored, topo.run.blob_store)
    refused = sum(1 for r in rows if r.refused)
    suffix = BATCH_EPOCH_FORMAT.format(epoch=args.epoch)
    records = feed_prompts(args.bootstrap_servers, topo.kafka, topo.topics.input, rows, topo.run.prompt_batch_size,
                           id_suffix=suffix)
    dead = f", {refused} dead-lettered to {topo.topics.input}.dlq (media refused)" if refused else ""
    print(f"expstream feed: run {args.run_id} epoch {args.epoch}: fed {len(rows) - refused} prompts in {records} "
          f"records to {topo.topics.input} (batch ids p000000{suffix}.., prompt ids <id>{suffix}){dead}")
    return EXIT_OK


FEED = Command("feed", "publish a prompt file to a running pipeline's input topic (Kubernetes; docs/deploy.md)",
               add_feed_arguments, feed_command, reads_topology=True)
