"""`make demo`: a small transformer trained in fp16 whose residual stream grows block after block
until it overflows, under ``watch()``; the report ends with the module where the inf was born.
Run: python -m overflow_fast.demo [--drop-in] [--check module|batch]."""

import argparse

import torch
from torch import nn

from overflow_fast import DebugUnderflowOverflow, watch


class Block(nn.Module):
    def __init__(self, width, heads, gain):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(4 * width, width)
        with torch.no_grad():
            # a badly scaled init: each block's MLP amplifies the residual stream by `gain`
            self.fc_out.weight.mul_(gain)

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc_out(self.act(self.fc_in(self.ln_2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=128, width=32, heads=4, depth=4, gain=50.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, gain**i) for i in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drop-in", action="store_true",
                        help="the reference-compatible DebugUnderflowOverflow on forwards, instead of watch()")
    parser.add_argument("--check", choices=["module", "batch"], default=None)
    parser.add_argument("--frames", type=int, default=12, help="max_frames_to_save")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer().half()
    ids = torch.randint(0, 128, (2, 16))
    if args.drop_in:
        check = args.check or "module"
        detector = DebugUnderflowOverflow(model.eval(), max_frames_to_save=args.frames, check=check)
        what = f"DebugUnderflowOverflow (check={check!r})"
    else:
        check = args.check or "batch"
        detector = watch(model, max_frames_to_save=args.frames, check=check)
        what = f"watch() (check={check!r}: gradients, keyword inputs and model outputs too)"
    print(f"A 4-block transformer in float16 (max {torch.finfo(torch.float16).max:.0f}); "
          f"overflow_fast {what} watches {len(detector.module_names)} modules.")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        for step in range(3):
            if args.drop_in:
                with torch.no_grad():
                    model(ids)
            else:
                optimizer.zero_grad()
                model(ids).float().logsumexp(-1).mean().backward()
                optimizer.step()
            print(f"batch {step}: finite")
    except ValueError as error:
        print(f"\nThe run stopped with: ValueError: {error}")
    finally:
        detector.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
