"""Forward/backward smoke of every variant on a tiny config: `python -m model.smoke`."""

from __future__ import annotations

import time

import torch

from . import VARIANTS, build_model, preset
from .flops import flops_per_token
from .freezing import count_params


def main() -> None:
    print(f"{'variant':<20}{'loss':>8}{'trainable':>11}{'frozen':>9}{'MFLOP/token':>13}{'ms/step':>9}")
    for variant in VARIANTS:
        cfg = preset("tiny", variant=variant, vocab_size=256, max_seq_len=64)
        model = build_model(cfg, seed=0)
        x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        ms = 1000 * (time.perf_counter() - start)
        n = count_params(model)
        print(
            f"{variant:<20}{loss.item():>8.3f}{n['trainable']:>11,}{n['frozen']:>9,}"
            f"{flops_per_token(cfg, 63)['train'] / 1e6:>13.2f}{ms:>9.1f}"
        )


if __name__ == "__main__":
    main()
