"""The one pass every method shares (``import pyattr.methods._core as core``): the model's
inputs (ids or pixels, masks, positions by the model's convention, caches, baselines),
the pass state, module taps, the forward and the backward. Each job is its own module;
this face names what the methods use."""

from pyattr.methods._core.taps import ARG_KEYS, check_not_streams, record_modules, resolve_module, stream_tails, streams_relevance, tap, taps  # noqa: F401
from pyattr.methods._core.inputs import (  # noqa: F401
    Prepared, check_count, check_length, check_token_ids, entry_not_reached, is_pixels, max_positions, prepare, rule_defaults,
    select_rows,
)
from pyattr.methods._core.passes import SparseRowsHeadFunction, attribution_pass, check_grad_mode, inference_state, sparse_rows_head  # noqa: F401
