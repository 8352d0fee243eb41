"""Observability inside each process: Prometheus metrics per stage process and the start-up timeline marks.

What reads them (status, report) is an operator tool: expstream/tools/."""
