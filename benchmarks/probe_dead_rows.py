"""The bare cuDNN attention kernels with a fully masked query row and few key/value positions (GPU only).

The random-case run found one wrong case that the bare kernel gets wrong as well: a bool mask converted to an
additive ``-inf`` bias, one fully masked query row, a single key/value position. This script maps where the
kernels go wrong (S_kv, S_q, heads, head dim, dtype, the fill value, whether a row is fully masked, the
mask's memory layout) and tries candidate remedies on the same inputs:

* ``zero_dead_grad``: grad_out of fully masked rows set to 0 before the backward;
* ``pad_kv``: K/V and the bias padded with masked positions up to a multiple of 8;
* ``finfo_min``: ``finfo(dtype).min`` as the fill instead of ``-inf``.

Run: ``python benchmarks/probe_dead_rows.py --out results.json`` (prints one line per wrong case and a
summary; the file holds the status counts per group and every case that was not right). ``--dry-run``: the first
cases of the grid on the CPU stand-in kernels (``tests/standin_kernels.py``), to check the set-up, not the kernels.
The rule for "wrong" is the GPU probe's: an error above 5x the same computation's eager error in the low precision
(+1e-3), or a NaN where the reference has none. A fully masked row's reference is 0; a row counts as fully
masked where the kernels read it so (``masked_rows``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

NAMES = ("out", "dq", "dk", "dv")
#: Where the cases run: "cpu" (the stand-in kernels) with ``--dry-run``.
DEVICE = "cuda"


def poison() -> None:
    """Fill memory the caching allocator will hand out next with NaN, so a kernel reading unwritten or
    foreign memory cannot pass by luck."""
    junk = torch.empty(64 << 20 if DEVICE == "cuda" else 1024, dtype=torch.float32, device=DEVICE).fill_(float("nan"))
    del junk


def masked_rows(bias: torch.Tensor) -> torch.Tensor:
    """(B, 1, S_q, 1): rows whose every key is masked as the kernels read the bias: -inf, or a value whose
    exp2-domain score overflows float32 (finfo(bf16).min does; fp16's -65504 is an ordinary bias)."""
    return torch.isneginf(bias.float() * 1.4426950408889634).all(-1, keepdim=True)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, g: torch.Tensor, dtype: Any):
    """Attention in ``dtype`` with autograd, (B, H, S, D) inputs; a fully masked row gives 0."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        s = leaves[0] @ leaves[1].transpose(-2, -1) * q.shape[-1] ** -0.5 + bias.to(dtype)
        dead = masked_rows(bias)
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        out = p @ leaves[2]
        out.backward(g.to(dtype))
    return [t.detach().double() for t in (out, *(x.grad for x in leaves))]


def kernel(q, k, v, bias, g, *, zero_dead_grad: bool = False, pad_kv: bool = False):
    """The bare cuDNN forward and backward ops on (B, H, S, D) inputs."""
    skv = k.shape[-2]
    dead = masked_rows(bias)
    if pad_kv and skv % 8:
        extra = 8 - skv % 8
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], extra, k.shape[-1])], dim=-2)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], extra, v.shape[-1])], dim=-2)
        bias = torch.cat([bias, bias.new_full((*bias.shape[:-1], extra), float("-inf"))], dim=-1)
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query=q, key=k, value=v, attn_bias=bias, compute_log_sumexp=True, dropout_p=0.0, is_causal=False,
        return_debug_mask=False, scale=None,
    )  # fmt: skip
    if zero_dead_grad:
        g = g.masked_fill(dead, 0.0)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=g, query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed, philox_offset=offset,
        attn_bias=bias, cum_seq_q=cq, cum_seq_k=ck, max_q=mq, max_k=mk, dropout_p=0.0, is_causal=False, scale=None,
    )  # fmt: skip
    return [t.double() for t in (out, dq, dk[..., :skv, :], dv[..., :skv, :])]


def case(b, h, sq, skv, d, dtype, fill, dead_row, bias_layout, remedy, seed) -> dict[str, Any]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, g = (torch.randn(b, h, sq, d, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, h, skv, d, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    keep = torch.rand(b, 1, sq, skv, generator=gen, device=DEVICE) < 0.75
    keep[..., 0] = True
    if dead_row:
        keep[:, :, sq // 2, :] = False
    value = float("-inf") if fill == "-inf" else torch.finfo(dtype).min
    if bias_layout == "dense":
        bias = torch.zeros(b, 1, sq, skv, dtype=dtype, device=DEVICE).masked_fill_(~keep, value)
    else:  # "padded": the same values in a buffer whose rows are 8-aligned (a view, S_kv not a multiple of 8)
        width = (skv + 7) // 8 * 8
        buf = torch.zeros(b, 1, sq, width, dtype=dtype, device=DEVICE)
        bias = buf[..., :skv].masked_fill_(~keep, value)
    poison()
    ref = eager(q.double(), k.double(), v.double(), bias.double(), g.double(), torch.float64)
    low = eager(q, k, v, bias, g, dtype)
    try:
        got = kernel(q, k, v, bias, g, zero_dead_grad=remedy == "zero_dead_grad", pad_kv=remedy == "pad_kv")
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as exc:
        return {"status": "raised", "error": str(exc).splitlines()[0][:160]}
    errors, wrong = {}, []
    for name, r, lo, x in zip(NAMES, ref, low, got, strict=True):
        err = torch.nan_to_num((x - r).abs(), nan=float("inf")).max().item()
        limit = 5 * (lo - r).abs().max().item() + 1e-3
        errors[name] = round(err, 5)
        if err > limit:
            wrong.append(name)
    return {"status": "wrong" if wrong else "ok", "wrong": wrong, "errors": errors}


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="probe-dead-rows.json")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; stops starting cases after")
    parser.add_argument("--dry-run", action="store_true", help="a few cases on the CPU stand-in kernels")
    args = parser.parse_args()
    if args.dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import standin_kernels

        standin_kernels.register()
        DEVICE = "cpu"
    deadline = time.monotonic() + args.budget
    grid = itertools.product(
        (1, 2, 3, 5, 8, 9, 16),  # S_kv
        (2, 7, 8, 77),  # S_q
        (1, 3),  # heads
        (32, 80, 128),  # head dim
        (torch.bfloat16, torch.float16),
        ("-inf", "finfo_min"),
        (True, False),  # a fully masked row
        ("dense", "padded"),  # the bias's memory
        ("none", "zero_dead_grad", "pad_kv"),
    )
    rows: list[dict[str, Any]] = []
    for skv, sq, h, d, dtype, fill, dead_row, layout, remedy in grid:
        if time.monotonic() > deadline or (args.dry_run and len(rows) == 4):
            break
        if not dead_row and remedy == "zero_dead_grad":
            continue
        if (sq, skv) == (1, 1):
            continue
        params = {"B": 2, "H": h, "Sq": sq, "Skv": skv, "D": d, "dtype": str(dtype).removeprefix("torch."),
                  "fill": fill, "dead_row": dead_row, "bias_layout": layout, "remedy": remedy}  # fmt: skip
        result = case(2, h, sq, skv, d, dtype, fill, dead_row, layout, remedy, seed=len(rows))
        rows.append({**params, **result})
        if result["status"] != "ok":
            print(json.dumps(rows[-1]), flush=True)
    summary: dict[str, dict[str, int]] = {}
    for row in rows:
        key = f"remedy={row['remedy']} dead_row={row['dead_row']} skv={row['Skv']}"
        summary.setdefault(key, {}).setdefault(row["status"], 0)
        summary[key][row["status"]] += 1
    for key in sorted(summary):
        print(key, summary[key])
    print(f"{len(rows)} cases, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    # The file: status counts per group (over heads, head dims and bias layouts), then every case not ok.
    groups: dict[str, dict[str, int]] = {}
    for row in rows:
        key = (
            f"remedy={row['remedy']} fill={row['fill']} dtype={row['dtype']} Skv={row['Skv']} Sq={row['Sq']} "
            f"masked_row={row['dead_row']}"
        )
        groups.setdefault(key, {}).setdefault(row["status"], 0)
        groups[key][row["status"]] += 1
    result = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cases": len(rows),
        "groups": dict(sorted(groups.items())),
        "not_ok": [row for row in rows if row["status"] != "ok"],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
