"""Fast batched generation for dense Hugging Face decoders (Llama, Mistral, Qwen2, Qwen3).

    gen = BatchedGenerator(model, max_slots=1024)                     # model: an HF *ForCausalLM, eval mode
    outs = gen.generate(prompts, max_new_tokens=256, eos_token_id=tok.eos_token_id)   # list[list[int]]

The engine runs the model's own modules (embedding, norms, q/k/v/o projections, Qwen3's q/k norms, MLP, final norm,
LM head, rotary tables), so no model class is copied per family; it owns only the KV cache and the attention.

- A static KV cache `k_cache, v_cache [layers, slots, kv_heads, capacity, head_dim]` and per-slot state (last token,
  position, tokens generated, request key, done flag, outputs) live in buffers on the object.
- Prefill: the prompts admitted into free slots, right-padded and causal (padding never reaches a real token).
- Decode step: one token for every slot in `[0, b)`, attention over cache positions `[0, lb)` with a per-slot length
  mask. It reads and writes only the static buffers, so on CUDA it is captured once per (slot bucket b, length bucket
  lb, greedy|sampled) into a CUDA graph kept on the object (`graphs`) and replayed; on the CPU it runs eagerly.
- Continuous batching: finished slots (EOS, inclusive, or max_new_tokens) are harvested every `check_every` steps and
  refilled with waiting prompts; with none waiting, live slots are compacted to the front so the step runs at a
  smaller slot bucket.
- Sampling: inverse CDF of softmax(logits / T) at one uniform from a counter-based hash of (request key, token
  index), so a request's tokens do not depend on its slot, the slot count or the other requests.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
M32 = 0xFFFFFFFF


def unsupported_reason(model) -> str | None:
    """None when `BatchedGenerator` can run `model`, else why not (hybrids, sliding windows, dynamic RoPE...)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        return f"model_type {family!r} is not one of the supported dense families {SUPPORTED_FAMILIES}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "it has layers other than full attention (sliding-window or linear-attention layers)"
    if family == "mistral" and getattr(cfg, "sliding_window", None):
        return "it uses a sliding attention window"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"its rope_type {rope['rope_type']!r} changes the frequencies with the sequence length"
    return None


# ---- counter-based sampling -----------------------------------------------------------------------------
def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32 (a Python int or an int64 tensor), without int64 overflow."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & M32


def hash32(x):
    """A 32-bit integer hash (Wellons' lowbias32); the same on Python ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def request_key(seed: int, index: int) -> int:
    """The 32-bit sampling key of request `index` under `seed`."""
    k = hash32(hash32(seed & M32) ^ ((seed >> 32) & M32))
    return hash32(k ^ (index & M32))


def sample_tokens(logits: torch.Tensor, temperature, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """logits [R, V], keys [R] and counters [R] (int64) -> token ids [R] drawn from softmax(logits / temperature).

    Row r uses the uniform u = hash(keys[r], counters[r]) through the inverse CDF (float64), so a draw depends only
    on its own row. `temperature` is a float or a one-element tensor (> 0).
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    cdf = probs.to(torch.float64).cumsum(-1)                                        # [R, V]
    u = (hash32(keys ^ hash32(counters & M32)).to(torch.float64) + 0.5) / 2.0**32   # [R] in (0, 1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_(max=logits.shape[-1] - 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _decode_attention(q, kc, vc, masked, scale: float) -> torch.Tensor:
    """q [b, H, 1, D], kc/vc [b, KV, lb, D] (cache prefix views), masked [b, 1, 1, lb] bool (True: past the slot's
    length) -> [b, 1, H*D]. Query heads h*G..h*G+G-1 share KV head h (HF's repeat_kv order); softmax in >= fp32.
    """
    b, H, _, D = q.shape
    kv = kc.shape[1]
    s = torch.matmul(q.reshape(b, kv, H // kv, D) * scale, kc.transpose(-1, -2))    # [b, KV, G, lb]
    p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    return torch.matmul(p.to(vc.dtype), vc).reshape(b, 1, H * D)


class BatchedGenerator:
    """Greedy / temperature generation with a static KV cache, captured decode steps and continuous batching.

    Args:
        model: an HF causal LM of a supported dense family (`unsupported_reason(model)` is None), eval mode.
        max_slots: sequences decoded at once (the decode batch). Default 256.
        max_len: the most cache positions one request may use (prompt + new tokens); the cache is allocated for
            what a call needs (rounded up to 256) and grows up to this. Default 4096.
        cuda_graphs: capture the decode step into CUDA graphs. Default: on for CUDA models.
        prefill_tokens: padded prompt tokens per prefill forward. Default 32768.
        check_every: decode steps between host checks for finished slots. Default 4.
        refill_fraction: refill once this fraction of the slots is free (or none is live). Default 1/8.
        min_bucket: smallest slot bucket the step is compacted to. Default 16.
    After `generate`, `stats` holds counters of the call (steps, slot-steps, prefill batches, captures, seconds).
    """

    def __init__(self, model, *, max_slots: int = 256, max_len: int = 4096, cuda_graphs: bool | None = None,
                 prefill_tokens: int = 32768, check_every: int = 4, refill_fraction: float = 0.125,
                 min_bucket: int = 16):
        reason = unsupported_reason(model)
        if reason:
            raise TypeError(f"BatchedGenerator cannot run {type(model).__name__}: {reason}")
        if max_slots < 1 or max_len < 2 or prefill_tokens < 1 or check_every < 1 or not 0 < refill_fraction <= 1:
            raise ValueError(f"need max_slots >= 1, max_len >= 2, prefill_tokens >= 1, check_every >= 1 and "
                             f"0 < refill_fraction <= 1; got {max_slots}, {max_len}, {prefill_tokens}, "
                             f"{check_every}, {refill_fraction}")
        self.model = model
        self.base = model.get_decoder()
        self.layers = list(self.base.layers)
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        attn = self.layers[0].self_attn
        self.n_kv, self.head_dim = model.config.num_key_value_heads, attn.head_dim
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device, self.dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        self.max_slots, self.max_len = max_slots, max_len
        self.use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.prefill_tokens, self.check_every, self.min_bucket = prefill_tokens, check_every, min_bucket
        self.refill_at = max(1, int(max_slots * refill_fraction))
        S, dev, i64 = max_slots, self.device, torch.long
        self.tokens = torch.zeros(S, dtype=i64, device=dev)        # [S] last token, fed at `pos` next step
        self.pos = torch.zeros(S, dtype=i64, device=dev)           # [S] its position (= tokens so far - 1)
        self.n_new = torch.zeros(S, dtype=i64, device=dev)         # [S] tokens generated so far
        self.keys = torch.zeros(S, dtype=i64, device=dev)          # [S] request sampling keys
        self.done = torch.ones(S, dtype=torch.bool, device=dev)    # [S] finished or free
        self.eos = torch.full((1,), -1, dtype=i64, device=dev)     # call settings, as tensors for the graphs
        self.max_new = torch.ones(1, dtype=i64, device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.capacity = 0                                          # cache positions allocated
        self.k_cache = self.v_cache = self.out = None
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.stats: dict = {}

    # ---- buffers and captured steps ----------------------------------------------------------------------
    def _reserve(self, need: int) -> None:
        """Make the cache hold `need` positions per slot (reallocating drops the captured graphs)."""
        if need <= self.capacity:
            return
        self.graphs.clear()
        self.k_cache = self.v_cache = self.out = None
        cap = min(self.max_len, -(-need // 256) * 256)
        shape = (len(self.layers), self.max_slots, self.n_kv, cap, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)   # zeros: masked slots stay finite
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.out = torch.zeros(self.max_slots, cap, dtype=torch.long, device=self.device)   # [S, cap] new tokens
        self.positions = torch.arange(cap, device=self.device)                              # [cap]
        cos, sin = self.base.rotary_emb(self.k_cache.new_zeros(1), self.positions[None])   # [1, cap, D]
        self.cos, self.sin = cos[0], sin[0]
        self.capacity = cap

    def _project(self, attn, x, cos, sin):
        """x [B, T, hidden], cos/sin [B or 1, T, D] -> q [B, H, T, D], k and v [B, KV, T, D] (RoPE applied)."""
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, self.head_dim)
        k = attn.k_proj(x).view(B, T, -1, self.head_dim)
        v = attn.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):                                                   # Qwen3: per-head RMSNorm
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _step(self, b: int, lb: int, sample: bool) -> None:
        """One decode step for slots [0, b) over cache positions [0, lb); touches only the static buffers."""
        tok, pos, done, n = self.tokens[:b], self.pos[:b], self.done[:b], self.n_new[:b]
        h = self.embed(tok)[:, None]                                        # [b, 1, hidden]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]           # [b, 1, D]
        masked = (self.positions[:lb] > pos[:, None])[:, None, None]        # [b, 1, 1, lb] past each length
        at = pos.view(b, 1, 1, 1).expand(b, self.n_kv, 1, self.head_dim)    # [b, KV, 1, D]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._project(attn, layer.input_layernorm(h), cos, sin)
            kc, vc = self.k_cache[i, :b], self.v_cache[i, :b]              # [b, KV, cap, D]
            kc.scatter_(2, at, k)
            vc.scatter_(2, at, v)
            h = h + attn.o_proj(_decode_attention(q, kc[:, :, :lb], vc[:, :, :lb], masked, attn.scaling))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.base.norm(h[:, 0]))                     # [b, V]
        nxt = sample_tokens(logits, self.temperature, self.keys[:b], n) if sample else logits.argmax(-1)
        live = ~done
        nxt = torch.where(live, nxt, tok)
        self.out[:b].scatter_(1, n[:, None], nxt[:, None])
        tok.copy_(nxt)
        n.add_(live.long())
        pos.add_(live.long())
        done.logical_or_((nxt == self.eos) | (n >= self.max_new))

    def _run_step(self, b: int, lb: int, sample: bool) -> None:
        if not self.use_graphs:
            return self._step(b, lb, sample)
        key = (b, lb, sample)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        self.graphs[key].replay()

    def _capture(self, b: int, lb: int, sample: bool) -> torch.cuda.CUDAGraph:
        """Warm up and capture `_step(b, lb, sample)`. All slots are marked done meanwhile, so the warm-up runs
        change no state (they rewrite the K/V a live slot's next step writes anyway)."""
        t0 = time.perf_counter()
        saved = self.done.clone()
        self.done.fill_(True)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(b, lb, sample)
            torch.cuda.current_stream().wait_stream(side)
            self._pool = self._pool or torch.cuda.graph_pool_handle()     # one memory pool for all the steps
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(b, lb, sample)
        finally:
            self.done.copy_(saved)
        self.stats["captures"] = self.stats.get("captures", 0) + 1
        self.stats["capture_seconds"] = self.stats.get("capture_seconds", 0.0) + time.perf_counter() - t0
        return graph

    def _bucket(self, n: int) -> int:
        return min(self.max_slots, max(self.min_bucket, _next_pow2(n)))

    # ---- prefill, harvest, compaction --------------------------------------------------------------------
    def _prefill(self, slots: list[int], prompts: list[list[int]], keys: list[int], sample: bool) -> None:
        """Prefill `prompts` into `slots` and pick each one's first new token (counter 0)."""
        logits = self._prefill_logits(slots, prompts)                                          # [n, V]
        sl = torch.tensor(slots, device=self.device)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        kt = torch.tensor(keys, device=self.device)
        first = sample_tokens(logits, self.temperature, kt, torch.zeros_like(kt)) if sample else logits.argmax(-1)
        self.tokens[sl], self.pos[sl], self.keys[sl], self.n_new[sl] = first, lens, kt, 1
        self.out[sl, 0] = first
        self.done[sl] = (first == self.eos) | (self.max_new <= 1)

    def _prefill_logits(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Write the K/V of `prompts` into `slots`; -> the next-token logits after each prompt [n, V]."""
        n, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=self.device)   # [n, T] right-padded
        lens = torch.tensor([len(p) for p in prompts], device=self.device)                    # [n]
        sl = torch.tensor(slots, device=self.device)
        h = self.embed(ids)                                                                   # [n, T, hidden]
        cos, sin = self.cos[:T][None], self.sin[:T][None]                                     # [1, T, D]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._project(attn, layer.input_layernorm(h), cos, sin)
            self.k_cache[i][sl, :, :T] = k
            self.v_cache[i][sl, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(n, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.base.norm(h[torch.arange(n, device=self.device), lens - 1]))     # [n, V]

    def _admit(self, slots, reqs, prompts, keys, sample) -> None:
        """Prefill requests `reqs` into `slots`, longest first, in forwards of <= prefill_tokens padded tokens."""
        order = sorted(range(len(reqs)), key=lambda j: -len(prompts[reqs[j]]))
        while order:
            width, take = len(prompts[reqs[order[0]]]), 1
            while take < len(order) and (take + 1) * width <= self.prefill_tokens:
                take += 1
            chunk, order = order[:take], order[take:]
            self._prefill([int(slots[j]) for j in chunk], [prompts[reqs[j]] for j in chunk],
                          [keys[reqs[j]] for j in chunk], sample)
            self.stats["prefill_batches"] += 1

    def _compact(self, slot_req: np.ndarray, pos_h: np.ndarray) -> None:
        """Move the live slots into [0, n_live) so the step runs at a smaller bucket."""
        act = np.nonzero(slot_req >= 0)[0]
        m = len(act)
        src, dst = act[act >= m], np.nonzero(slot_req[:m] < 0)[0]
        if m == 0 or self._bucket(m) >= self._bucket(int(act[-1]) + 1):
            return
        s, d = torch.from_numpy(src).to(self.device), torch.from_numpy(dst).to(self.device)
        width = int(pos_h[src].max()) + 1
        for buf in (self.k_cache, self.v_cache):
            buf[:, d, :, :width] = buf[:, s, :, :width]
        for buf in (self.tokens, self.pos, self.n_new, self.keys, self.done, self.out):
            buf[d] = buf[s]
        self.done[s] = True
        slot_req[dst], pos_h[dst], slot_req[src] = slot_req[src], pos_h[src], -1
        self.stats["compactions"] += 1

    # ---- the public call ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_id: int | None = None, seed: int | Sequence[int] = 0) -> list[list[int]]:
        """prompts (token id lists, any lengths) -> the new token ids of each, in input order.

        Each response ends at the first `eos_token_id` (included) or after `max_new_tokens`. temperature 0 is
        greedy (argmax, lowest id on ties); > 0 samples softmax(logits / temperature). `seed`: an int (request i
        gets `request_key(seed, i)`) or one seed per prompt (request i gets `request_key(seed[i], 0)`, so its
        tokens do not depend on which other prompts share the call).
        """
        prompts = [list(map(int, p)) for p in prompts]
        keys = self._check(prompts, max_new_tokens, temperature, seed)
        if not prompts:
            return []
        t0 = time.perf_counter()
        self._reserve(max(len(p) for p in prompts) + max_new_tokens)
        sample = temperature > 0
        self.temperature.fill_(temperature if sample else 1.0)
        self.eos.fill_(-1 if eos_token_id is None else int(eos_token_id))
        self.max_new.fill_(max_new_tokens)
        self.done.fill_(True)
        self.stats = dict(prompts=len(prompts), new_tokens=0, steps=0, slot_steps=0, prefill_batches=0,
                          compactions=0, captures=0, capture_seconds=0.0)
        S, k = self.max_slots, self.check_every
        slot_req = np.full(S, -1, dtype=np.int64)        # request held by each slot, -1: free
        pos_h = np.zeros(S, dtype=np.int64)              # host copy of `pos` (an upper bound between checks)
        waiting, results = deque(range(len(prompts))), [None] * len(prompts)
        while True:
            live = slot_req >= 0
            if live.any():                               # harvest (the one host sync per k steps)
                state = torch.stack([self.done.long(), self.n_new, self.pos]).cpu().numpy()   # [3, S]
                pos_h[:] = state[2]
                fin = np.nonzero(live & (state[0] == 1))[0]
                if len(fin):
                    counts = state[1][fin]
                    rows = self.out[torch.from_numpy(fin).to(self.device), :int(counts.max())].cpu().tolist()
                    for s, c, row in zip(fin, counts, rows):
                        results[slot_req[s]] = row[:c]
                    slot_req[fin] = -1
                    self.stats["new_tokens"] += int(counts.sum())
            free = np.nonzero(slot_req < 0)[0]
            if not waiting and len(free) == S:
                break
            if waiting and (len(free) >= self.refill_at or len(free) == S):
                reqs = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                slots = free[:len(reqs)]
                self._admit(slots, reqs, prompts, keys, sample)
                slot_req[slots] = reqs
                pos_h[slots] = [len(prompts[r]) for r in reqs]
            elif not waiting:
                self._compact(slot_req, pos_h)
            act = np.nonzero(slot_req >= 0)[0]
            b = self._bucket(int(act[-1]) + 1)
            lb = min(self.capacity, max(64, _next_pow2(int(pos_h[act].max()) + k)))
            for _ in range(k):
                self._run_step(b, lb, sample)
            pos_h[act] += k
            self.stats["steps"] += k
            self.stats["slot_steps"] += k * b
        self.stats["seconds"] = time.perf_counter() - t0
        return results

    @torch.no_grad()
    def prompt_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The next-token logits after each prompt [n, V] from the engine's prefill: what `generate` picks the first
        new token from (to compare with a reference). Uses the slots' cache like `generate`; no state is kept."""
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, 1, 0.0, 0)
        if not prompts:
            return torch.zeros(0, self.vocab_size, dtype=self.dtype, device=self.device)
        width = max(len(p) for p in prompts)
        self._reserve(width + 1)
        step = max(1, min(self.max_slots, self.prefill_tokens // width))
        rows = [self._prefill_logits(list(range(len(chunk))), chunk)
                for chunk in (prompts[i:i + step] for i in range(0, len(prompts), step))]
        self.done.fill_(True)
        return torch.cat(rows)

    def _check(self, prompts, max_new_tokens, temperature, seed) -> list[int]:
        """Validate a call; -> the request keys."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature >= 0 or temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if len(p) + max_new_tokens > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                                 f"{len(p) + max_new_tokens} cache positions, more than max_len={self.max_len}")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        if isinstance(seed, (int, np.integer)):
            return [request_key(seed, i) for i in range(len(prompts))]
        if len(seed) != len(prompts):
            raise ValueError(f"got {len(seed)} seeds for {len(prompts)} prompts; pass one int or one per prompt")
        return [request_key(int(s), 0) for s in seed]
