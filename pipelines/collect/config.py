"""Typed configuration of the collect job, loaded from YAML/JSON, validated before any work."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from pipelines.config_io import checked_fields, load_mapping
from tfm_runtime.loading import ModelSpec

RESPONSE_MODES = ("regenerate", "keep")
INPUT_FORMATS = ("auto", "prompt", "sharegpt")
ROLLOUT_ENGINE = "batched-v1"      # bump when regeneration changes its tokens (sampling keys, engine)


@dataclass
class CollectConfig:
    target: ModelSpec
    inputs: list[str]                     # jsonl/json/parquet files or folders of them
    output_dir: str
    drafter: ModelSpec | None = None      # required unless text_only (drafter training for a target with none)
    input_format: str = "auto"            # prompt: {"prompt": str} | sharegpt: {"conversations": [...]}
    prompt_field: str = "prompt"
    prompt_turn: str = "first"            # the user turn the response answers: first | last (multi-turn context)
    response: str = "regenerate"          # regenerate by the target, or keep the dataset's response
    temperature: float = 0.0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 2048         # longer prompts are skipped and counted
    max_response_tokens: int = 4096       # response: keep: longer responses are skipped and counted
    anchors_per_sequence: int = 16
    candidate_pool: int = 512             # K: DFlash top-K per depth
    target_topk: int = 32                 # k: target distribution kept per depth
    store_candidates: bool = True         # False: no cand_ids/cand_logits (= top-K of lm_head(dflash_hidden))
    text_only: bool = False               # token ids of the regenerated sequences only (drafter training)
    samples_per_shard: int = 64
    limit: int | None = None              # first N inputs only
    seed: int = 0
    num_actors: int = 1                   # model replicas (Ray actors) per stage
    gpus_per_actor: float = 0.0
    rollout_batch_size: int = 32
    device: str = "auto"                  # auto | cpu | cuda
    shard_retries: int = 2                # a shard whose stage fails is tried again this often, then recorded as
                                          # failed (the next run retries it); an actor that dies is restarted
    stall_seconds: float = 3600.0         # Ray: no shard finished for this long -> stop, record the shards still
                                          # out as failed (the next run retries them); longer than one shard takes
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.drafter is None and not self.text_only:
            raise ValueError("collect config: drafter is required (a DFlash drafter: its top-K candidates and taps "
                             "are what the shards hold) unless text_only is true, got none")
        self.target, self.drafter = ModelSpec.of(self.target), ModelSpec.of(self.drafter)
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        checks = [("response", self.response in RESPONSE_MODES, f"one of {RESPONSE_MODES}"),
                  ("input_format", self.input_format in INPUT_FORMATS, f"one of {INPUT_FORMATS}"),
                  ("prompt_turn", self.prompt_turn in ("first", "last"), "'first' or 'last'"),
                  ("temperature", self.temperature >= 0, ">= 0"),
                  ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                  ("max_prompt_tokens", self.max_prompt_tokens >= 1, ">= 1"),
                  ("max_response_tokens", self.max_response_tokens >= 1, ">= 1"),
                  ("shard_retries", self.shard_retries >= 0, ">= 0"),
                  ("stall_seconds", self.stall_seconds > 0, "> 0"),
                  ("anchors_per_sequence", self.anchors_per_sequence >= 1, ">= 1"),
                  ("candidate_pool", self.candidate_pool >= 1, ">= 1"),
                  ("target_topk", self.target_topk >= 1, ">= 1"),
                  ("samples_per_shard", self.samples_per_shard >= 1, ">= 1"),
                  ("num_actors", self.num_actors >= 1, ">= 1"),
                  ("inputs", len(self.inputs) >= 1, "at least one path")]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"collect config: {name} must be {expected}, got {getattr(self, name)!r}")

    # ---- files ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "CollectConfig":
        return cls(**checked_fields(cls, d, "collect config"))

    @classmethod
    def load(cls, path: str) -> "CollectConfig":
        return cls.from_dict(load_mapping(path, "collect config"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def data_hash(self) -> str:
        """Hash of every setting that changes the rows (not parallelism, batch sizes or retries): shards written
        under another hash are not reused on resume."""
        d = self.to_dict()
        for k in ("num_actors", "gpus_per_actor", "device", "output_dir", "limit", "shard_retries",
                  "stall_seconds"):
            d.pop(k)
        if self.response == "regenerate":
            d.pop("max_response_tokens")                     # max_new_tokens bounds regenerated responses
        d["rollout_engine"] = ROLLOUT_ENGINE
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
