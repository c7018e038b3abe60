"""The verifiable task: copy the prompt's digits.

A prompt is ``length`` digit tokens followed by a separator token; the right
completion is the same ``length`` digits. The reward is 1.0 for an exact match of
the whole completion and 0.0 otherwise, so a random policy over a vocabulary of
``V`` tokens starts near ``V ** -length`` and a policy that has learnt the rule
scores 1.0.

Token ids: digits are ``1..10``, the separator ``11``; the vocabulary is larger
(unused ids are wrong answers the policy must learn to avoid).
"""

from __future__ import annotations

import random

DIGITS = range(1, 11)
SEPARATOR = 11


def draw_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random digits and the separator."""
    return [[rng.choice(DIGITS) for _ in range(length)] + [SEPARATOR] for _ in range(count)]


def answer(prompt: list[int]) -> list[int]:
    """The completion the task asks for: the prompt's digits."""
    return prompt[:-1]


def reward(prompt: list[int], completion: list[int]) -> float:
    """1.0 when ``completion`` is exactly the prompt's digits, else 0.0."""
    return 1.0 if list(completion) == answer(prompt) else 0.0
