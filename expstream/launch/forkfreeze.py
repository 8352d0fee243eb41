"""Imported last by the fork server: move every object its imports made out of the garbage collector's reach.

A forked stage shares the fork server's memory pages until it writes to one. CPython's cyclic
garbage collector writes to every object it scans (its ``gc_refs`` bookkeeping), so the first
collections in each stage copied most of the torch/transformers module objects the server had
imported: 8 private copies. ``gc.freeze()`` moves everything that exists now into a permanent
generation the collector never scans (Python 3.7+; the pattern CPython's docs give for pre-fork
servers), so those pages stay shared. Reference-count updates still copy the pages of objects a
stage actually uses; the rest stays shared. Measured with bench/pipeline.py (PSS of the demo run).
"""

from __future__ import annotations

import gc

gc.collect()  # nothing collectable left behind in the frozen generation
gc.freeze()
