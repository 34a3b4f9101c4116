"""The tiny Llama the mini-engine tests run on the CPU: its config (`TINY`),
one model per test module (the `model` fixture; a test module imports it to
use it), and seeded prompts over its vocabulary."""

from __future__ import annotations

import random

import pytest

from pegaflow.minivllm import CONFIGS, LlamaModel

TINY = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(TINY, "cpu", seed=0)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY.vocab_size) for _ in range(n)]
