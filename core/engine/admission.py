"""Whether a request can ever be served here: checked before it is queued."""

from __future__ import annotations

from kvrunner.config import SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.errors import RequestError


def check_request(
    seq: Sequence, config: SchedulerConfig, block_manager: BlockManager, name: str
) -> None:
    """Raise RequestError naming the request (``name``) and the limit it exceeds."""
    if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table:
        raise RequestError(f"{name}: only a fresh sequence can be added")
    num_prompt = seq.num_prompt_tokens
    max_len = config.max_model_len
    if num_prompt == 0:
        raise RequestError(f"{name}: the prompt is empty")
    if num_prompt > max_len - 1:
        raise RequestError(
            f"{name}: prompt has {num_prompt} tokens but max_model_len={max_len} "
            f"allows at most {max_len - 1} (one token must be generated)"
        )
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and num_prompt > budget:
        raise RequestError(
            f"{name}: prompt has {num_prompt} tokens but max_num_batched_tokens={budget} "
            f"and chunked prefill is off"
        )
    # The last token is sampled, never fed, so it needs no KV. (An asynchronous step
    # past a stop feeds at most up to there too: a request certain to reach its length
    # limit is never scheduled past it.)
    final_len = min(num_prompt + seq.sampling_params.max_tokens, max_len)
    bm = block_manager
    need = bm.blocks_needed(final_len - 1)
    if need > bm.num_blocks:
        raise RequestError(
            f"{name}: needs up to {need} KV blocks ({final_len - 1} tokens: prompt "
            f"{num_prompt} + max_tokens {seq.sampling_params.max_tokens}, capped by "
            f"max_model_len={max_len}) but the whole pool has {bm.num_blocks} blocks "
            f"of {bm.block_size} tokens; raise num_blocks (or the cache budget) or "
            f"lower max_tokens"
        )
