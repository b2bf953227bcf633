"""A one-shot check of attnlab on a CUDA device (CI has no GPU; run this where one is lent).

Every local backend x {fp32, bf16} x the mask and score kinds, forward and q/k/v
gradients, against the fp64 reference of the test suite (computed on the same device);
then the production layer's KV cache, a tiny GPT's training steps and cached generation,
and a few timings of sdpa and blockwise against torch's kernel on the device.

    python benchmarks/gpu_check.py [--json OUT]

Prints one line per check and ``N passed, N failed`` at the end; exit status 1 when
anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.reference import reference_attention, tol  # noqa: E402

from attnlab import (  # noqa: E402
    AlibiBias,
    Attention,
    CausalMask,
    DocumentMask,
    PaddingMask,
    SlidingWindowMask,
    scaled_dot_product_attention,
)
from attnlab.backends import available_backends  # noqa: E402

RESULTS: list[dict[str, object]] = []


class NotServedError(Exception):
    """The backend declines the call, with its reason (not a failure)."""


def check(name: str, fn: Callable[[], str]) -> None:
    try:
        detail = fn()
        RESULTS.append({"check": name, "ok": True, "detail": detail})
        print(f"PASS {name}: {detail}", flush=True)
    except NotServedError as exc:
        RESULTS.append({"check": name, "ok": None, "detail": str(exc)})
        print(f"SKIP {name}: {exc}", flush=True)
    except Exception as exc:  # a failed check is reported, the rest still run
        RESULTS.append({"check": name, "ok": False, "detail": repr(exc)})
        print(f"FAIL {name}: {exc!r}", flush=True)
        traceback.print_exc(limit=3)


def _kinds(dev: torch.device, B: int, H: int, T: int) -> dict[str, dict[str, object]]:
    lengths = [T, T - 9]
    seg = torch.tensor([[0] * (T // 2) + [1] * (T - T // 2), [0] * 5 + [1] * (T - 5)], device=dev)
    return {
        "none": {},
        "causal": {"is_causal": True},
        "padding": {"attn_mask": PaddingMask.from_lengths(lengths, T)},
        "window": {"attn_mask": SlidingWindowMask(16)},
        "document&causal": {"attn_mask": DocumentMask(seg) & CausalMask()},
        "alibi&causal": {"attn_mask": AlibiBias(H) & CausalMask()},
        "softcap": {"is_causal": True, "softcap": 5.0},
        "sinks": {"is_causal": True, "sinks": torch.randn(H, device=dev)},
    }


def _dense(kw: dict[str, object], B: int, H: int, T: int, dev: torch.device):
    """The same call as a dense bool mask and fp64 bias, for the reference."""
    mask = kw.get("attn_mask")
    allowed = torch.ones(B, H, T, T, dtype=torch.bool, device=dev)
    bias = None
    if kw.get("is_causal"):
        allowed &= torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    if mask is not None:
        d = mask.dense(T, T, device=dev, dtype=torch.float64)  # type: ignore[attr-defined]
        if d.dtype == torch.bool:
            allowed &= d
        else:
            allowed &= torch.isfinite(d)
            bias = d.masked_fill(~torch.isfinite(d), 0.0)
    return allowed, bias


def backend_grid(dev: torch.device) -> None:
    B, H, G, T, D = 2, 4, 2, 97, 64
    for backend in [b for b in available_backends() if b != "ring"]:
        for dtype in (torch.float32, torch.bfloat16):
            for kind, kw in _kinds(dev, B, H, T).items():

                def run(backend=backend, dtype=dtype, kind=kind, kw=kw) -> str:
                    g = torch.Generator(device="cpu").manual_seed(0)
                    q = torch.randn(B, H, T, D, generator=g).to(dev, dtype).requires_grad_()
                    k = torch.randn(B, G, T, D, generator=g).to(dev, dtype).requires_grad_()
                    v = torch.randn(B, G, T, D, generator=g).to(dev, dtype).requires_grad_()
                    try:
                        out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
                    except ValueError as exc:
                        if "cannot serve this call" in str(exc):
                            raise NotServedError(str(exc)) from None
                        raise
                    assert isinstance(out, torch.Tensor)
                    dout = torch.randn_like(out)
                    out.backward(dout)
                    allowed, bias = _dense(kw, B, H, T, dev)
                    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
                    sinks = kw.get("sinks")
                    ref, _ = reference_attention(
                        qr,
                        kr,
                        vr,
                        allowed,
                        bias,
                        softcap=kw.get("softcap"),  # type: ignore[arg-type]
                        sinks=sinks,  # type: ignore[arg-type]
                    )
                    ref.backward(dout.double())
                    t = tol(dtype)
                    torch.testing.assert_close(out.double(), ref, **t)
                    for mine, theirs in ((q, qr), (k, kr), (v, vr)):
                        assert mine.grad is not None and theirs.grad is not None
                        # Gradients are sums over T rows: scale atol by their magnitude.
                        scale = max(1.0, theirs.grad.abs().max().item())
                        torch.testing.assert_close(
                            mine.grad.double(), theirs.grad, atol=t["atol"] * scale, rtol=t["rtol"]
                        )
                    err = (out.double() - ref).abs().max().item()
                    return f"max |out - ref| {err:.2e}"

                check(f"{backend} {str(dtype)[6:]} {kind}", run)


def layer_cache(dev: torch.device) -> str:
    torch.manual_seed(0)
    layer = Attention(128, 8, num_kv_heads=2, rope=True).to(dev).eval()
    x = torch.randn(1, 40, 128, device=dev)
    with torch.no_grad():
        full = layer(x, is_causal=True)
        cache = layer.new_kv_cache() if hasattr(layer, "new_kv_cache") else None
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    return "40 cached steps == full pass"


def gpt_train_and_generate(dev: torch.device) -> str:
    from attnlab.generation import generate
    from attnlab.models.gpt import GPTConfig, GPTModel

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPTModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 33), device=dev)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    model.eval()
    prompt = ids[:1, :8]
    a = generate(model, prompt, 16, use_cache=True)
    b = generate(model, prompt, 16, use_cache=False)
    assert torch.equal(a, b), (a, b)
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; 16 greedy tokens equal with/without cache"


def timings(dev: torch.device) -> str:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for T in (1024, 4096):
            q = torch.randn(1, 12, T, 64, device=dev, dtype=dtype)
            res = {}
            for name, fn in {
                "torch": lambda q=q: torch.nn.functional.scaled_dot_product_attention(
                    q, q, q, is_causal=True
                ),
                "sdpa": lambda q=q: scaled_dot_product_attention(
                    q, q, q, is_causal=True, backend="sdpa"
                ),
                "blockwise": lambda q=q: scaled_dot_product_attention(
                    q, q, q, is_causal=True, backend="blockwise"
                ),
                "auto": lambda q=q: scaled_dot_product_attention(q, q, q, is_causal=True),
            }.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                res[name] = (time.perf_counter() - t0) / 10 * 1e3
            rows.append(
                f"{str(dtype)[6:]} T={T}: torch {res['torch']:.3f} ms, "
                + ", ".join(f"{k} {v / res['torch']:.2f}x" for k, v in res.items() if k != "torch")
            )
    return " | ".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu for a dry run")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}", flush=True)
    backend_grid(dev)
    check("Attention KV cache on cuda", lambda: layer_cache(dev))
    check("GPT training + generation on cuda", lambda: gpt_train_and_generate(dev))
    if dev.type == "cuda":
        check("timings (causal, B=1, H=12, D=64)", lambda: timings(dev))
    passed = sum(r["ok"] is True for r in RESULTS)
    failed = sum(r["ok"] is False for r in RESULTS)
    if args.json is not None:
        args.json.write_text(json.dumps(RESULTS, indent=1))
    print(f"{passed} passed, {failed} failed, {len(RESULTS) - passed - failed} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
