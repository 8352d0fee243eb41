"""CPU-only stand-in for the few ``sgl_kernel`` ops SGLang imports unguarded on a CPU machine.

CPU-ONLY COMPATIBILITY CODE, never used on a GPU (see ../README.md). The registry's ``sglang-kernel``
wheel is a CUDA build, and SGLang's CPU kernels are only built from source for AVX-512/AMX Xeons.
With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports these names at start-up; ``make setup-sglang`` and
``expstream.models.sglang_server`` put this directory first on the server's ``PYTHONPATH``.

Only ``assign_req_to_token_pool_cpu`` runs (on every prefill), in plain torch. The rest are
speculative-decoding and KV-copy ops that run only with features expstream does not use; they raise.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+expstream-cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[r], start[r]:end[r]] = out_cache_loc[next end-start entries]``.

    The same as SGLang's Triton kernel ``assign_req_to_token_pool``: the rows' new cache slots lie
    one after another in ``out_cache_loc``, in row order.
    """
    del pool_len  # the row length of req_to_token; torch indexing knows it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not available in expstream's CPU stand-in (tools/sglang_cpu); "
            "it runs only with speculative decoding or KV-cache copies, which expstream does not use. "
            "On a GPU install the real sglang-kernel wheel."
        )

    op.__name__ = name
    return op


copy_all_layer_kv_cache_cpu = _unsupported("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
rotate_input_ids_cpu = _unsupported("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
