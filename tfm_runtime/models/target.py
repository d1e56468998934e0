"""Target wrapper: any Hugging Face causal LM -> logits, final-norm hidden state and tapped layer outputs.

Works for dense decoders (Llama, Qwen3) and hybrids with Gated DeltaNet layers (Qwen3-Next, Qwen3.5).
Tap convention (DFlash): tap i is the *output of decoder layer i*, i.e. `hidden_states[i + 1]` of
`output_hidden_states=True` (before the final norm). `h_final` is the input of the LM head (final norm output).

A TargetModel also says which model it is (`spec`: the ModelSpec it was loaded from, see tfm_runtime.loading), which
is what a Weaver adapter's contract is checked against: `model_id` (the contract's `target_id`), `revision` and
`tokenizer_hash`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tfm_runtime.loading import ModelSpec


@dataclass
class TargetOutput:
    logits: torch.Tensor        # [B, T, V]
    h_final: torch.Tensor       # [B, T, H]  final-norm hidden (LM-head input)
    taps: torch.Tensor          # [B, T, n_taps * H]  concatenated tap-layer outputs (empty if no taps)
    cache: object = None        # the transformers Cache passed in, now holding the new positions too


def _decoder(model: nn.Module) -> nn.Module:
    """The base model holding `layers` and `norm` (model.model for *ForCausalLM)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise TypeError(f"expected a Hugging Face causal LM with model.layers, got {type(model).__name__}")
    return base


class TargetModel(nn.Module):
    """Wraps an HF `*ForCausalLM`; `tap_layer_ids` are decoder-layer indices whose outputs are captured.

    `spec` (a ModelSpec or a spec string) names the model: `load_target` passes the spec it loaded; by default it is
    the Hugging Face model's `name_or_path` (the folder or Hub id given to `from_pretrained`), and None for a model
    built in code. A copy of a model (a local folder, another dtype) is declared with the id of the original:
    `TargetModel(model, taps, spec=ModelSpec("/models/copy", id="Qwen/Qwen3-8B"))`. `tokenizer_hash`: the
    contract's hash of the model's tokenizer when known; by default it is computed from `spec` on first use.
    """

    def __init__(self, model: nn.Module, tap_layer_ids: list[int] | tuple[int, ...] = (), *,
                 spec=None, tokenizer_hash: str | None = None):
        super().__init__()
        self.model = model
        self.spec = ModelSpec.of(spec) if spec is not None else (
            ModelSpec(model.name_or_path) if getattr(model, "name_or_path", "") else None)
        self._tokenizer_hash = tokenizer_hash
        self.base = _decoder(model)
        self.config = model.config
        n = len(self.base.layers)
        bad = [i for i in tap_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"tap layer ids must be in [0, {n - 1}] for this {n}-layer target; got {bad}")
        self.tap_layer_ids = tuple(int(i) for i in tap_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        for i in set(self.tap_layer_ids):
            self.base.layers[i].register_forward_hook(self._make_hook(i))

    def _make_hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    # ---- which model it is (checked against an adapter's contract) ---------------------------------
    @property
    def model_id(self) -> str | None:
        """The contract's `target_id` of this model (the spec's id, else its path); None when unknown."""
        return self.spec.name if self.spec is not None else None

    @property
    def revision(self) -> str | None:
        return self.spec.revision if self.spec is not None else None

    @property
    def tokenizer_hash(self) -> str | None:
        """`contract.tokenizer_hash` of the model's tokenizer: as given, else loaded from `spec` on first use (None
        without a spec)."""
        if self._tokenizer_hash is None and self.spec is not None:
            from tfm_runtime.contract import tokenizer_hash
            from tfm_runtime.loading import load_tokenizer
            try:
                tok = load_tokenizer(self.spec)
            except (OSError, ValueError) as e:
                raise FileNotFoundError(f"target {self.model_id!r}: cannot read its tokenizer to compare with the "
                                        f"adapter's tokenizer_hash ({e}); pass TargetModel(..., tokenizer_hash=...)"
                                        ) from e
            self._tokenizer_hash = tokenizer_hash(tok)
        return self._tokenizer_hash

    # ---- facts about the target ------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.base.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def embed_weight(self) -> torch.Tensor:          # [V, H]
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:        # [V, H]
        return self.model.get_output_embeddings().weight

    @property
    def layer_types(self) -> list[str]:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        return any(t == "linear_attention" for t in self.layer_types)

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def new_cache(self):
        from transformers import DynamicCache
        return DynamicCache(config=self.config)

    # ---- forward ---------------------------------------------------------------------------------
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final-norm hidden states: h [..., H] -> [..., V]."""
        return self.model.get_output_embeddings()(h)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask=None, cache=None, use_cache: bool = False, logits: bool = True) -> TargetOutput:
        """input_ids [B, T] -> TargetOutput. `cache`: a transformers Cache (`new_cache`), extended in place.
        `attention_mask` may be a custom 4D additive mask [B, 1, T, kv_len] (tree verification) or a dict
        {layer_type: mask}. With `logits=False` the LM head is skipped (TargetOutput.logits is None; apply `head` to
        the positions needed)."""
        self._captured.clear()
        # `cache`: the name transformers uses since 5.24 (`past_key_values` is deprecated, removed in 5.40)
        out = self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                        use_cache=use_cache)
        h = out.last_hidden_state                                   # [B, T, H] (after final norm)
        out_logits = self.head(h) if logits else None               # [B, T, V]
        if self.tap_layer_ids:
            taps = torch.cat([self._captured[i] for i in self.tap_layer_ids], dim=-1)
        else:
            taps = h.new_zeros(*h.shape[:-1], 0)
        self._captured.clear()
        return TargetOutput(logits=out_logits, h_final=h, taps=taps, cache=out.cache)


def default_tap_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default choice of tap layers: round(1 + i*(n_target-4)/(n_draft-1)), i < n_draft."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
