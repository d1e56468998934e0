"""Deterministic tiny "worlds": a target, a DFlash drafter and a Weaver, built in code.

Random weights, millisecond forwards on a CPU, no download. Families: dense `llama`, `qwen3`; hybrid
`qwen3_next`, `qwen3_5` (Gated DeltaNet + full attention layers).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tfm_runtime.contract import Contract, tokenizer_hash
from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
from tfm_runtime.models.target import TargetModel, default_tap_layers
from tfm_runtime.models.weaver import Weaver, WeaverConfig

FAMILIES = ("llama", "qwen3", "qwen3_next", "qwen3_5")
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5")

# The one set of tiny sizes: `tiny:<family>[:seed]` specs (collect, train, load_target) and tiny_world() agree.
TINY_VOCAB = 262            # 256 bytes + 3 ChatML specials (tiny_tokenizer) + spare ids; the last is the mask token
TINY_HIDDEN = 64
TINY_LAYERS = 6
TINY_BLOCK = 8              # DFlash block size (bonus + 7 masks)
TINY_POOL = 32              # DFlash top-K candidates per depth
TINY_DRAFTER_LAYERS = 2


@dataclass
class World:
    family: str
    target: TargetModel
    drafter: DFlashDrafter
    weaver: Weaver
    contract: Contract


def tiny_target_config(family: str, vocab_size: int = TINY_VOCAB, hidden: int = TINY_HIDDEN,
                       layers: int = TINY_LAYERS):
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(**common)
    if family == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(head_dim=hidden // 4, **common)
    # hybrids: layer i is full attention when (i+1) % 4 == 0, like the real models; make sure both kinds occur
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    gdn = dict(layer_types=types, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, head_dim=hidden // 4)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                               shared_expert_intermediate_size=hidden, **gdn, **common)
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        return Qwen3_5TextConfig(**gdn, **common)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def tiny_spec(family: str, seed: int, sizes_are_default: bool) -> str:
    """The name of a tiny model: the spec `tiny:<family>:<seed>` that loads it, or a name of its own (no spec loads
    it) for other sizes."""
    return f"tiny:{family}:{seed}" if sizes_are_default else f"tiny-{family}-seed{seed}-custom"


@functools.cache
def tiny_tokenizer_hash(vocab_size: int = TINY_VOCAB) -> str:
    return tokenizer_hash(tiny_tokenizer(vocab_size))


def tiny_target(family: str = "llama", *, seed: int = 0, dtype=torch.float32, vocab_size: int = TINY_VOCAB,
                hidden: int = TINY_HIDDEN, layers: int = TINY_LAYERS, tap_layer_ids=None,
                attn_implementation: str = "sdpa"):
    """A random-initialised HF causal LM wrapped as TargetModel (deterministic in `seed`), named by `tiny_spec`."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_target_config(family, vocab_size, hidden, layers)
    torch.manual_seed(seed)
    if family == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
        model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation=attn_implementation)
    else:
        extra = {"experts_implementation": "eager"} if family == "qwen3_next" else {}   # grouped_mm has no fp64
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, **extra)
    model = model.to(dtype).eval()
    taps = tap_layer_ids if tap_layer_ids is not None else default_tap_layers(layers, TINY_DRAFTER_LAYERS)
    default = (vocab_size, hidden, layers) == (TINY_VOCAB, TINY_HIDDEN, TINY_LAYERS)
    return TargetModel(model, taps, spec=tiny_spec(family, seed, default),
                       tokenizer_hash=tiny_tokenizer_hash() if default else None)


def tiny_drafter_config(family: str = "llama", *, vocab_size: int = TINY_VOCAB, hidden: int = TINY_HIDDEN,
                        layers: int = TINY_LAYERS, block_size: int = TINY_BLOCK,
                        drafter_layers: int = TINY_DRAFTER_LAYERS) -> DFlashConfig:
    """The tiny DFlash drafter's config for a tiny target of `layers` layers (any family: the drafter is dense)."""
    return DFlashConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=drafter_layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab_size,
                        num_target_layers=layers, target_layer_ids=default_tap_layers(layers, drafter_layers),
                        mask_token_id=vocab_size - 1, block_size=block_size)


def tiny_drafter(family: str = "llama", *, seed: int = 0, dtype=torch.float32, **sizes) -> DFlashDrafter:
    """The random-initialised drafter of `tiny_world(family, seed=seed)` (deterministic in `seed`)."""
    torch.manual_seed(seed + 1)
    cfg = tiny_drafter_config(family, **sizes)
    return DFlashDrafter(cfg, spec=tiny_spec(family, seed, cfg == tiny_drafter_config(family))).to(dtype).eval()


def tiny_world(family: str = "llama", *, seed: int = 0, dtype=torch.float32, vocab_size: int = TINY_VOCAB,
               hidden: int = TINY_HIDDEN, layers: int = TINY_LAYERS, block_size: int = TINY_BLOCK,
               candidate_pool: int = TINY_POOL, drafter_layers: int = TINY_DRAFTER_LAYERS) -> World:
    target = tiny_target(family, seed=seed, dtype=dtype, vocab_size=vocab_size, hidden=hidden, layers=layers,
                         tap_layer_ids=default_tap_layers(layers, drafter_layers))
    drafter = tiny_drafter(family, seed=seed, dtype=dtype, vocab_size=vocab_size, hidden=hidden, layers=layers,
                           block_size=block_size, drafter_layers=drafter_layers)
    dcfg = drafter.cfg
    wcfg = WeaverConfig(d_model=hidden, d_embed=hidden, d_rank=32, num_layers=2, num_heads=2, mlp_dim=64,
                        lookahead=block_size - 1, candidate_pool=candidate_pool)
    torch.manual_seed(seed + 2)
    weaver = Weaver(wcfg).to(dtype).eval()
    # the default sizes are what the spec `tiny:<family>:<seed>` loads (tfm_runtime.loading), with the tiny tokenizer
    default = (vocab_size, hidden, layers) == (TINY_VOCAB, TINY_HIDDEN, TINY_LAYERS)
    contract = Contract(target_id=target.model_id, target_revision=None, drafter_id=drafter.model_id,
                        drafter_revision=None, vocab_size=vocab_size, target_hidden_size=hidden,
                        drafter_hidden_size=hidden, tap_layer_ids=tuple(target.tap_layer_ids), block_size=block_size,
                        mask_token_id=dcfg.mask_token_id, candidate_pool=candidate_pool, lookahead=block_size - 1,
                        tokenizer_hash=tiny_tokenizer_hash() if default else None)
    weaver.contract = contract                             # as load_adapter sets it: SpeculativeDecoder checks it
    return World(family, target, drafter, weaver, contract)


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level tokenizer (ids 0..255 = bytes) with ChatML specials at 256.. and a chat template; no download.

    The last id (vocab_size - 1) is left for the DFlash mask token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    if vocab_size < 256 + len(TINY_SPECIALS) + 1:
        raise ValueError(f"tiny tokenizer needs vocab_size >= {256 + len(TINY_SPECIALS) + 1}, got {vocab_size}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _bytelevel_index(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


def _bytelevel_index(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable remapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(extra)})
    return table[ch]
