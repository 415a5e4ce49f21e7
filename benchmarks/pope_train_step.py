"""A whole PoPE decoder's training step on CUDA: the fused kernel against PoPE through SDPA and RoPE.

Three decoders of one architecture (the PoPE paper's 124M LM by default: 12 x 768, 12 heads, SwiGLU,
RMSNorm), built by ``poslab.build_model`` from one seed:
  rope         RoPE, attn_backend sdpa (the baseline every ratio is against)
  pope-sdpa    PoPE materialised to 2d-wide q/k, attn_backend sdpa (what the authors ran)
  pope-fused   PoPE, attn_backend triton (poslab.kernels.pope_flash)
Each runs the trainer's step -- bf16 autocast forward, next-token loss, backward, fused AdamW -- on the
same random tokens. The three alternate in rounds so that a clock change hits them alike; the time per
model is the median over rounds of the mean step time in a round. Printed: ms/step, tokens/s, peak memory
of a step above the model and optimizer state, and each PoPE model's ratios to RoPE. Issue 7's kernel
targets are about attention alone (benchmarks/pope_kernel.py); this is what a user training a model sees.
Without CUDA it prints one line and exits 0.

    python benchmarks/pope_train_step.py [--seq-len 1024 4096] [--tokens 16384] [--d-model 768]
                                         [--layers 12] [--heads 12] [--rounds 5] [--steps 5]
                                         [--configs FILE (launch configurations from pope_kernel_configs.py)]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

import poslab
from pope_kernel import use_configs  # benchmarks/ is the script's directory

MODELS = {"rope": ("rope", "sdpa"), "pope-sdpa": ("pope", "sdpa"), "pope-fused": ("pope", "triton")}


def build(scheme: str, backend: str, args, seq_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return poslab.build_model({
        "arch": "decoder", "vocab_size": 50304, "d_model": args.d_model, "n_layers": args.layers,
        "n_heads": args.heads, "max_seq_len": seq_len, "norm": "rmsnorm", "mlp": "swiglu",
        "attn_backend": backend, "positional": {"name": scheme},
    }).cuda()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq_len per step")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    parser.add_argument("--configs", help="JSON of launch configurations per head dim (pope_kernel_configs.py --out)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"pope_train_step benchmark: no CUDA device here (torch {torch.__version__}); nothing measured")
        return 0
    head_dim = str(args.d_model // args.heads)
    configs = json.load(open(args.configs)).get(head_dim, {}) if args.configs else {}
    if configs:
        use_configs(configs)
    print(f"# launch configurations: {configs or 'defaults'}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}, "
          f"{args.layers} x {args.d_model}, {args.heads} heads, {args.tokens} tokens/step, bf16 autocast")
    print(f"{'n':>6} {'b':>3} {'model':>10} | {'ms/step':>8} {'tok/s':>9} {'peak MiB':>9} | vs rope: time, mem")
    for n in args.seq_len:
        b = max(1, args.tokens // n)
        gen = torch.Generator(device="cuda").manual_seed(0)
        tokens = torch.randint(0, 50304, (b, n), device="cuda", generator=gen)
        states = {}
        for name, (scheme, backend) in MODELS.items():
            model = build(scheme, backend, args, n)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            states[name] = (model, opt)

        def step(name: str) -> None:
            model, opt = states[name]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        peak = {}
        for name in MODELS:  # warm-up (kernel compilation, optimizer state) and the peak of one step
            step(name)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(name)
            torch.cuda.synchronize()
            peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = {name: [] for name in MODELS}
        for _ in range(args.rounds):
            for name in MODELS:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(name)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / args.steps)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        for name in MODELS:
            print(f"{n:>6} {b:>3} {name:>10} | {ms[name]:8.1f} {b * n / ms[name] * 1e3:9.0f} {peak[name]:9.0f} | "
                  f"{ms[name] / ms['rope']:5.2f}x {peak[name] / peak['rope']:5.2f}x")
        states.clear()  # free the three models before the next length
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
