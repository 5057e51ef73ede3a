"""Random weights for `--load-format dummy`: benchmark a model's shape without its checkpoint."""
from __future__ import annotations

import torch

# Small enough that activations never overflow in bf16/fp16 through dozens of layers.
DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in place: norm weights with 1, the rest uniform in +-`DUMMY_WEIGHT_RANGE`.

    Values are drawn on each parameter's own device and dtype (no host round trip, so an 8B model on a
    GPU takes well under a second) from a generator seeded per parameter name, so the values depend on
    `seed`, the name and the shape only, not on the order in which parameters are visited.
    """
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
            continue
        if not param.is_floating_point():
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(_param_seed(seed, name))
        param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def _param_seed(seed: int, name: str) -> int:
    # A stable hash (Python's str hash is salted per process, so workers would disagree).
    h = seed & 0xFFFFFFFF
    for byte in name.encode():
        h = (h * 1000003 ^ byte) & 0xFFFFFFFFFFFF
    return h
