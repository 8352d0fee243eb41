"""Operator tools: recording and recorder, replay, rewind, dlq, show, diff, tail, status and the run report."""
