"""The reference trainer of the continuous loop (``expstream train``; docs/async.md).

Public API for a trainer of one's own: :class:`ExperienceStream` (the ``experiences`` topic with
positions under the trainer's control), the losses, :class:`PolicyTrainer` (one optimisation step),
the checkpoint, and :func:`run_trainer` (the whole loop). Weights are published with
``expstream.train.weights`` (``open_store``, ``announce``); KL is reported with ``expstream.train.control``.
"""

from expstream.train.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from expstream.train.loss import OFF_POLICY_MODES, LossTerms, importance_weights, policy_loss, value_loss
from expstream.train.step import PolicyTrainer, StepResult, experience_from_records, trained_mask
from expstream.train.stream import ExperienceStream
from expstream.train.trainer import experiences_topic, run_trainer, sample_versions

__all__ = [
    "OFF_POLICY_MODES",
    "Checkpoint",
    "CheckpointError",
    "ExperienceStream",
    "LossTerms",
    "PolicyTrainer",
    "StepResult",
    "experience_from_records",
    "experiences_topic",
    "importance_weights",
    "policy_loss",
    "read_checkpoint",
    "run_trainer",
    "sample_versions",
    "trained_mask",
    "value_loss",
    "write_checkpoint",
]
