#!/usr/bin/env python3
"""A model server for the agent benchmark: random weights, deterministic.

python3 model_server.py --port P [--seed S] [--weights-gb W] [--kv-gb K]
                        [--backend auto|transformers|torch] [--ready FILE]
                        [--weights DIR] [--ref-n N]
python3 model_server.py --save-weights DIR [--seed S] [--weights-gb W] [--backend B]

Loads a causal LM with random weights (seeded, so the same seed gives the
same model) and preallocates a KV cache of K GB, so that the process holds
about W + K GB of device memory like a serving engine does. Then serves
HTTP on 127.0.0.1:P (the port opens only once the model is loaded, so the
agent and the benchmark see a cold start end there):

  GET /health                      -> "ok"
  GET /generate?prompt=TEXT&n=N    -> "tok tok ...\n" (greedy, N new tokens)
  POST /sleep[?level=1]            -> frees the KV cache (del + torch.cuda.empty_cache),
                                      weights stay: vLLM's sleep level 1 without the
                                      weights' offload (gpusnap's suspend moves them)
  POST /wake_up                    -> allocates (and touches) the KV cache again
  GET /is_sleeping                 -> {"is_sleeping": true|false}
  (asleep, /health and /generate answer 503, as a sleeping engine serves nothing)

With transformers (LlamaForCausalLM from a config, random init on the GPU)
or, when it is missing or --backend torch, a plain PyTorch model (embedding,
a stack of MLP blocks, a head), greedy either way: same prompt, same tokens.

--save-weights DIR writes the seeded random weights to DIR as safetensors
shards (~2 GB each, fsynced, `complete` written last) and exits. --weights DIR
loads them from there instead of initialising, as a real server loads its
checkpoint: the model is built on the meta device (no init), its storage
allocated on the GPU, and every shard read from disk straight onto it
(transformers: the rotary embedding's computed buffers are built anew; if the
model has other unsaved buffers it falls back to a random init before the
load, and says so in its ready line: init=meta or init=random).
"""

import argparse
import hashlib
import http.server
import os
import sys
import threading
import time
import urllib.parse

import torch

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, default=None)
# A server in a network namespace of its own listens on its interface.
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--weights-gb", type=float, default=float(os.environ.get("AGENT_WEIGHTS_GB", "16")))
p.add_argument("--kv-gb", type=float, default=float(os.environ.get("AGENT_KV_GB", "59")))
p.add_argument("--backend", default=os.environ.get("AGENT_BACKEND", "auto"))
p.add_argument("--ready", default=None)
# The answer to this prompt is computed once at start-up, before anything can
# suspend the process, and served by /reference without touching the GPU:
# every later answer of this process must equal it (greedy decoding over
# random weights is not reproducible across processes: near-equal logits
# flip with cuBLAS's choice of algorithm, so another process is no reference).
p.add_argument("--ref-prompt", default="the quick brown fox jumps over the lazy dog")
p.add_argument("--ref-n", type=int, default=16)
p.add_argument("--weights", default=None, help="load the weights from this directory (--save-weights wrote it)")
p.add_argument("--save-weights", default=None, help="write the seeded weights to this directory and exit")
args = p.parse_args()
if args.port is None and not args.save_weights:
    p.error("--port is required (unless --save-weights)")

t0 = time.time()
torch.manual_seed(args.seed)
torch.cuda.manual_seed_all(args.seed)
dev = torch.device("cuda")
VOCAB = 32000
HIDDEN = 4096
backend = args.backend
if backend == "auto":
    try:
        import transformers  # noqa: F401

        backend = "transformers"
    except Exception:
        backend = "torch"

if backend == "transformers":
    from transformers import LlamaConfig, LlamaForCausalLM

    inter = 14336
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * 1024 + 3 * HIDDEN * inter) * 2
    layers = max(1, int((args.weights_gb * 1e9 - 2 * VOCAB * HIDDEN * 2) // per_layer))
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    torch.set_default_dtype(torch.bfloat16)
    init = "random"
    model = None
    if args.weights:
        try:
            from transformers.models.llama import modeling_llama

            with torch.device("meta"):
                model = LlamaForCausalLM(cfg)
            model.to_empty(device=dev)
            # Computed, not saved: built anew on the GPU.
            model.model.rotary_emb = modeling_llama.LlamaRotaryEmbedding(config=cfg, device=dev)
            saved = set(model.state_dict().keys())
            other = [n for n, _ in model.named_buffers() if n not in saved and "rotary_emb" not in n]
            if other:
                print(f"unsaved buffers {other[:3]}: random init before the load", flush=True)
                model = None
            else:
                init = "meta"
        except Exception as e:  # an API that moved: the slower, safe path
            print(f"meta init failed ({e!r}): random init before the load", flush=True)
            model = None
    if model is None:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    model.eval()

    def tensors():
        return model.state_dict()

    def load(sd):
        with torch.no_grad():
            missing = model.load_state_dict(sd, strict=False)
        return missing

    def generate(ids, n):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device=dev),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(ids):].tolist()

else:
    width = 4 * HIDDEN
    per_block = 2 * HIDDEN * width * 2
    blocks = max(1, int((args.weights_gb * 1e9 - 2 * VOCAB * HIDDEN * 2) // per_block))
    emb = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    ws = [
        (
            torch.randn(HIDDEN, width, device=dev, dtype=torch.bfloat16) * 0.02,
            torch.randn(width, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(blocks)
    ]
    head = torch.randn(HIDDEN, VOCAB, device=dev, dtype=torch.bfloat16) * 0.02
    init = "random"

    def tensors():
        d = {"emb": emb, "head": head}
        for i, (a, b) in enumerate(ws):
            d[f"w.{i}.a"], d[f"w.{i}.b"] = a, b
        return d

    def load(sd):
        with torch.no_grad():
            for k, v in sd.items():
                tensors()[k].copy_(v)

    def generate(ids, n):
        out = []
        ids = list(ids)
        with torch.no_grad():
            for _ in range(n):
                h = emb[torch.tensor(ids, device=dev)].mean(0, keepdim=True)
                for a, b in ws:
                    h = h + torch.relu(h @ a) @ b
                    h = h / (h.float().norm() + 1e-3).to(h.dtype)
                tok = int(torch.argmax((h @ head).float(), dim=-1).item())
                out.append(tok)
                ids.append(tok)
        return out

if args.save_weights:
    from safetensors.torch import save_file

    os.makedirs(args.save_weights, exist_ok=True)
    shard, size, n, seen = {}, 0, 0, set()

    def flush():
        global shard, size, n
        if not shard:
            return
        path = os.path.join(args.save_weights, f"model-{n:05d}.safetensors")
        save_file(shard, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        shard, size, n = {}, 0, n + 1

    for k, v in tensors().items():
        if v.data_ptr() in seen:  # tied: saved once
            continue
        seen.add(v.data_ptr())
        shard[k] = v.detach().to("cpu").contiguous()
        size += v.numel() * v.element_size()
        if size >= 2e9:
            flush()
    flush()
    total = sum(os.path.getsize(os.path.join(args.save_weights, f)) for f in os.listdir(args.save_weights))
    with open(os.path.join(args.save_weights, "complete"), "w") as f:
        f.write(f"{backend} {args.weights_gb} {args.seed} {total}\n")
    print(f"saved {n} shards, {total / 1e9:.2f} GB, backend={backend}, in {time.time() - t0:.1f} s", flush=True)
    sys.exit(0)

load_gb = 0.0
if args.weights:
    from safetensors.torch import load_file

    for f in sorted(os.listdir(args.weights)):
        if f.endswith(".safetensors"):
            path = os.path.join(args.weights, f)
            load_gb += os.path.getsize(path) / 1e9
            load(load_file(path, device="cuda"))
    if backend == "transformers" and hasattr(model, "tie_weights"):
        model.tie_weights()
    torch.cuda.synchronize()

KV_LOCK = threading.Lock()


def alloc_kv():
    """The KV cache a serving engine preallocates: touched, so it is resident."""
    t = torch.empty(int(args.kv_gb * 1e9), dtype=torch.uint8, device=dev)
    t.fill_(1)
    torch.cuda.synchronize()
    return t


kv = alloc_kv()
load_s = time.time() - t0


def tokenize(text):
    return [int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little") % VOCAB for w in text.split()] or [1]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def answer(self, text, code=200):
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global kv
        u = urllib.parse.urlparse(self.path)
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        t = time.time()
        with KV_LOCK:
            if u.path == "/sleep":
                if kv is not None:
                    kv = None
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                held = torch.cuda.memory_reserved() / 1e9
                return self.answer(f'{{"slept_s": {time.time() - t:.3f}, "reserved_gb": {held:.1f}}}\n')
            if u.path == "/wake_up":
                if kv is None:
                    try:
                        kv = alloc_kv()
                    except Exception as e:  # out of memory: the agent must know
                        return self.answer(f"wake_up failed: {e!r}\n", 500)
                held = torch.cuda.memory_reserved() / 1e9
                return self.answer(f'{{"woke_s": {time.time() - t:.3f}, "reserved_gb": {held:.1f}}}\n')
        self.send_error(404)

    def do_GET(self):
        u = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(u.query)
        if u.path == "/is_sleeping":
            return self.answer('{"is_sleeping": %s}\n' % ("true" if kv is None else "false"))
        if u.path in ("/health", "/generate") and kv is None:
            return self.answer("asleep: POST /wake_up first\n", 503)
        if u.path == "/health":
            # Touch the GPU: a suspended server holds the request, as it would
            # a real one.
            k = kv
            if k is None:
                return self.answer("asleep: POST /wake_up first\n", 503)
            k[:1].add_(0)
            torch.cuda.synchronize()
            return self.answer("ok\n")
        if u.path == "/generate":
            prompt = q.get("prompt", ["hello world"])[0]
            n = int(q.get("n", ["16"])[0])
            toks = generate(tokenize(prompt), n)
            return self.answer(" ".join(map(str, toks)) + "\n")
        if u.path == "/reference":
            return self.answer(REFERENCE)
        self.send_error(404)


# --ref-n 0 (a cold-start measurement): no reference, the port opens sooner.
REFERENCE = (" ".join(map(str, generate(tokenize(args.ref_prompt), args.ref_n))) + "\n") if args.ref_n > 0 else ""
srv = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
held = torch.cuda.memory_allocated() / 1e9
print(
    f"ready pid={os.getpid()} backend={backend} init={init} weights={args.weights or 'random'} "
    f"read_gb={load_gb:.1f} load_s={load_s:.1f} held_gb={held:.1f}",
    flush=True,
)
if args.ready:
    with open(args.ready, "w") as f:
        f.write(f"{os.getpid()} {backend} {load_s:.2f} {held:.1f}\n")
try:
    srv.serve_forever()
except KeyboardInterrupt:
    sys.exit(0)
