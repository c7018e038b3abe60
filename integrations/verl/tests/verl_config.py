"""What the plugin's tests share: the tiny engine, verl's composed trainer config
with kvrunner selected, and the in-process reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE = dict(enforce_eager=True, cpu_cache_bytes=4 << 20, block_size=16)
PROMPT = [3, 17, 29, 101]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": True}


def compose_trainer_config(model: str, *overrides: str, tensor_parallel_size: int = 1) -> Any:
    """verl's ``ppo_trainer`` config (its own hydra files) with rollout ``kvrunner``
    on ``model`` at ``tensor_parallel_size``, small limits, 1 MiB weight buckets and
    ``overrides`` on top."""
    import verl
    from hydra import compose, initialize_config_dir

    conf = Path(verl.__file__).parent / "trainer" / "config"
    kv = ",".join(f"{k}:{v}" for k, v in ENGINE.items())
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return compose("ppo_trainer", overrides=[
            "actor_rollout_ref.rollout.name=kvrunner",
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel_size}",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            "actor_rollout_ref.rollout.prompt_length=64",
            "actor_rollout_ref.rollout.response_length=400",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
            f"+actor_rollout_ref.rollout.engine_kwargs.kvrunner={{{kv}}}",
            *overrides,
        ])


def in_process(path: str, max_tokens: int = 6) -> list[int]:
    """Greedy tokens of the in-process ``LLM`` on checkpoint ``path``."""
    from kvrunner import LLM, SamplingParams

    with LLM(path, **ENGINE) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([PROMPT], params)[0].token_ids
