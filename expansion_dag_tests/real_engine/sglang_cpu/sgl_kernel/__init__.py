"""A pure-torch stand-in for sgl-kernel's CPU build, for SGLang's CPU path in the real-engine tests.

Test support, not part of the project: ``expansion_dag_tests/real_engine/sglang_cpu/`` goes on the
PYTHONPATH of the SGLang servers the tests start (``support.SGLANG_CPU_COMMAND``), so this package
is ``sgl_kernel`` there. Why it exists: SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports
names of sgl-kernel's CPU build at import time, and that build is not on PyPI (the ``sgl-kernel``
and ``sglang-kernel`` wheels are CUDA-only).

Only ``assign_req_to_token_pool_cpu`` is called when serving a dense text model
(``srt/mem_cache/allocation.py``, once per batch); it is written here in torch. Every other
``*_cpu`` name imports, so that SGLang's modules load, and fails loudly if it is ever called: a
test then says which op to add instead of serving wrong answers. No op is registered under
``torch.ops.sgl_kernel``, so SGLang's AMX check (``convert_weight_packed``) is false and its
norms, activations and rotary embeddings run as plain torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV cache locations into its row of ``req_to_token``.

    Request ``i`` owns row ``req_pool_indices[i]`` and gets positions ``start_offset[i]`` to
    ``end_offset[i]``; its locations are the next ``end - start`` entries of ``out_cache_loc``,
    which holds every request's locations back to back (the Triton kernel
    ``assign_req_to_token_pool`` in the same file does the same on GPUs).
    """
    del pool_len  # the row length: implied by req_to_token's shape here
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


def _missing(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the pure-torch stand-in "
            f"(expansion_dag_tests/real_engine/sglang_cpu/sgl_kernel): SGLang's CPU path called it"
        )

    op.__name__ = name
    return op


def __getattr__(name: str) -> Callable[..., Any]:
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(f"module 'sgl_kernel' (the pure-torch stand-in) has no attribute {name!r}")
