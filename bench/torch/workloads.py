"""The workloads of the PyTorch proof (bench/torch/run_workloads.py): the same programs as the
traces in shared/traces, built from configs (nothing downloaded), seeded so that two runs in fresh
processes do the same work. Each returns per-step outputs to compare across allocators."""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any, Callable

import torch

SEED = 1234
# Set by run_workloads.py under cucache: called after each step's synchronize, outside the timed
# window; its snapshots (PROBES, one per step) say what the allocator did during each step.
STEP_PROBE: Callable[[], dict[str, int]] | None = None
PROBES: list[dict[str, int]] = []


def _timed(step: Callable[[int], Any], steps: int) -> tuple[list[Any], list[float]]:
    outs, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(step(i))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000.0)
        if STEP_PROBE is not None:
            PROBES.append(STEP_PROBE())
    return outs, times


def resnet50_train(steps: int) -> dict[str, Any]:
    import torchvision

    torch.manual_seed(SEED)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    x = torch.randn(64, 3, 224, 224, device="cuda", generator=gen)
    y = torch.randint(0, 1000, (64,), device="cuda", generator=gen)

    def step(_: int) -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    losses, times = _timed(step, steps)
    return {"kind": "train", "outputs": losses, "step_ms": times}


def _gpt2_train(steps: int, dynamic: bool) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(SEED)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    vocab = model.config.vocab_size

    def step(_: int) -> float:
        b, t = (rng.randint(4, 16), rng.randint(64, 1024)) if dynamic else (8, 1024)
        ids = torch.randint(0, vocab, (b, t), device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.item())

    losses, times = _timed(step, steps)
    return {"kind": "train", "outputs": losses, "step_ms": times}


def gpt2_train(steps: int) -> dict[str, Any]:
    return _gpt2_train(steps, dynamic=False)


def gpt2_train_dynseq(steps: int) -> dict[str, Any]:
    return _gpt2_train(steps, dynamic=True)


def gpt2_generate(steps: int) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

    class _Checksum(LogitsProcessor):
        # Sums the (finite) scores on the device as generation goes: a checksum of every logit
        # without keeping them (which would inflate the peak both allocators are measured on).
        def __init__(self) -> None:
            self.total = torch.zeros((), dtype=torch.float64, device="cuda")

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            s = scores.double()
            self.total += torch.where(torch.isfinite(s), s, torch.zeros_like(s)).sum()
            return scores

    torch.manual_seed(SEED)
    cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    model = GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).eval()
    rng = random.Random(SEED)
    vocab = cfg.vocab_size

    def step(i: int) -> dict[str, Any]:
        b, prompt, new = rng.randint(1, 16), rng.randint(16, 128), rng.randint(64, 256)
        torch.manual_seed(SEED + i)
        ids = torch.randint(0, vocab, (b, prompt), device="cuda")
        check = _Checksum()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=50,
                max_new_tokens=new,
                min_new_tokens=new,
                use_cache=True,
                pad_token_id=cfg.eos_token_id,
                logits_processor=LogitsProcessorList([check]),
            )
        tokens = out.cpu().numpy().tobytes()
        return {"tokens_sha": hashlib.sha256(tokens).hexdigest()[:16], "logits_sum": float(check.total.item())}

    outs, times = _timed(step, steps)
    return {"kind": "generate", "outputs": outs, "step_ms": times}


def bert_serve(steps: int) -> dict[str, Any]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    cfg = BertConfig()
    model = BertModel(cfg).cuda().half().eval()
    rng = random.Random(SEED)
    gen = torch.Generator(device="cuda").manual_seed(SEED)

    def step(_: int) -> dict[str, Any]:
        b, t = rng.randint(1, 64), rng.randint(8, 512)
        ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda", generator=gen)
        with torch.inference_mode():
            h = model(input_ids=ids).last_hidden_state
        raw = h.float().cpu().numpy().tobytes()
        return {"sha": hashlib.sha256(raw).hexdigest()[:16], "sum": float(h.double().sum().item())}

    outs, times = _timed(step, steps)
    return {"kind": "serve", "outputs": outs, "step_ms": times}


WORKLOADS: dict[str, Callable[[int], dict[str, Any]]] = {
    "resnet50_train": resnet50_train,
    "gpt2_train": gpt2_train,
    "gpt2_train_dynseq": gpt2_train_dynseq,
    "gpt2_generate": gpt2_generate,
    "bert_serve": bert_serve,
}
