"""The per-step metadata the paged backend hands its layers."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True)
class PagedMetadata:
    """Views of persistent buffers, plus host-side sizes for this step.

    ``slot_mapping`` is the backend's own buffer (:mod:`.builder`); the read side is
    the core's shared step metadata. All are slices of buffers allocated once, so a
    graph captured with one metadata object reads whatever a later step wrote into
    them. The ints are host values fixed when the object was built; the decode
    path depends only on tensor shapes and contents, which is what makes it replayable.
    """

    #: ``[num_padded_tokens]`` int64: slot of each token row; PAD_SLOT_ID rows write nothing
    slot_mapping: torch.Tensor
    #: ``[num_padded_seqs, max_blocks_per_seq]`` int32: physical block of each logical block
    block_tables: torch.Tensor
    #: ``[num_padded_seqs]`` int32: keys per sequence including this step's; 0 on padded rows
    context_lens: torch.Tensor
    #: ``[num_padded_seqs + 1]`` int32: cumulative query lengths; padded rows are empty
    query_start_loc: torch.Tensor
    num_seqs: int
    num_padded_seqs: int
    num_tokens: int
    max_query_len: int
    #: every sequence has exactly one new token: the decode kernel runs
    is_decode: bool
    #: a real prefill (not a decode, a capture or the start-up profile): its keys and
    #: values may set the scales of a layer that calculates them
    calibrates: bool = False
