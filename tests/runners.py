"""Test helpers shared by the runner tests: a StageRunner on a thread, and an experience record."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from schemas import Ragged, SampleBatch
from stages.runner import StageRunner


class Running:
    """StageRunner.run() on a daemon thread; whatever it raises is kept in ``error``."""

    def __init__(self, runner: StageRunner) -> None:
        self.runner = runner
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:  # surfaced by wait() and stop()
            self.error = exc

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        name = self.runner.stage.name
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.error is None, f"{name}: runner died: {self.error!r}"
            assert self.thread.is_alive(), f"{name}: runner stopped"
            assert time.monotonic() < deadline, f"{name}: timed out after {timeout_s}s waiting for {what}"
            time.sleep(0.05)

    def stop(self, *, reraise: bool = True) -> None:
        """Ask the runner to stop and join it; ``reraise``: raise what it raised (else read ``error``)."""
        self.runner.stop_requested = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "runner did not stop within 30s"
        if reraise and self.error is not None:
            raise self.error


def exp_batch(batch_id: str, group: str, indices: list[int]) -> SampleBatch:
    """An experience (advantage stage output) of ``len(indices)`` samples of ``group``."""
    b = len(indices)
    rows = [np.array([7, 9], np.int32)] * b
    f = Ragged.from_rows([np.array([0.5, -0.5], np.float32)] * b, "float32")
    return SampleBatch(
        batch_id=batch_id, policy_version=3, n_samples_per_prompt=4, eos_token_id=9, pad_token_id=0,
        prompt_id=[group] * b, group_id=[group] * b, sample_index=indices, prompt=["p"] * b, label=[""] * b,
        reference=[""] * b, response=["r"] * b, prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)] * b, "int32"),
        response_ids=Ragged.from_rows(rows, "int32"), layout="padded", action_ids=Ragged.from_rows(rows, "int32"),
        action_mask=Ragged.from_rows([np.ones(2, bool)] * b, "bool"), action_log_probs=f, advantages=f, returns=f,
        info={"reward": np.ones(b, np.float32)})
