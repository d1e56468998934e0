"""Typed configuration of a training run (Weaver, or a DFlash drafter), loaded from YAML/JSON and validated
before any work; the DeepSpeed config is derived from a few of its settings."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from pipelines.config_io import checked_fields, load_mapping
from tfm_runtime.loading import ModelSpec

MODELS = ("weaver", "dflash")
LOSSES = ("kl", "ce")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    data: list[str]                       # collect output folders (anchor shards; text-only shards for dflash)
    output_dir: str                       # the run folder: config, metrics, checkpoints, final/ and best/ models
    allow_incomplete_data: bool = False   # train on folders whose manifest is not marked complete (collect still
                                          # running, interrupted, or with failed shards): on the shards they list
    model: str = "weaver"                 # weaver | dflash
    target: ModelSpec | None = None       # default: the target named by the shards' contract
    # ---- Weaver size (d_model, d_embed, lookahead and candidate pool come from the shards' contract)
    preset: str | None = None             # "qwen36_27b": the published sizes (d_rank 1024, 3 layers, ...)
    d_rank: int = 256
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 768
    # ---- DFlash drafter (model: dflash)
    drafter_layers: int = 1
    block_size: int = 16
    drafter_intermediate_size: int | None = None   # default: 2 x target hidden (as z-lab's small drafters)
    anchors_per_sequence: int = 16        # random block starts per sequence and step
    loss_decay_gamma: float = 7.0         # dflash loss weight exp(-(k-1)/gamma) at block position k
    max_seq_len: int = 2048
    # ---- objective
    loss: str = "kl"                      # kl: candidate-restricted KL to the target | ce: cross-entropy on x_{i+d}
    depth_gamma: float | None = None      # Weaver depth weights exp(-d/gamma); None: all depths equal
    # ---- optimisation
    steps: int = 1000                     # optimizer steps
    micro_batch: int = 32                 # rows (weaver) or sequences (dflash) per process and micro step
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.1             # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_bad_steps: int = 5                # steps with a non-finite loss or gradient norm are skipped; this many in
                                          # a row stop the run (exit code 2, the last checkpoint kept)
    zero_stage: int = 2                   # 0, 1 or 2 (3 is refused: evaluation and saving need the whole model)
    precision: str = "auto"               # auto: bf16 on GPU, fp32 on CPU
    compile: str = "auto"                 # torch.compile the objective's forward: auto (Weaver on GPU) | on | off
    score_group_rows: int = 4             # GPU Weaver: score groups of N rows over their distinct LM-head rows
                                          # in both passes (real candidate sets overlap, so fewer rows are
                                          # read); 0: one gather per candidate
    seed: int = 0
    # ---- evaluation and checkpoints
    heldout_fraction: float = 0.05        # of the sequences (by sample_id), never trained on
    eval_every: int = 100
    eval_rows: int = 256                  # held-out rows (weaver) or sequences (dflash) per evaluation
    eval_budgets: list[int] = field(default_factory=lambda: [16, 64])
    checkpoint_every: int = 200
    keep_last: int = 2
    log_every: int = 10
    device: str = "auto"                  # auto | cpu | cuda

    def __post_init__(self):
        self.target = ModelSpec.of(self.target)
        if isinstance(self.data, str):
            self.data = [self.data]
        checks = [("model", self.model in MODELS, f"one of {MODELS}"),
                  ("loss", self.loss in LOSSES, f"one of {LOSSES}"),
                  ("precision", self.precision in PRECISIONS, f"one of {PRECISIONS}"),
                  ("preset", self.preset in (None, "qwen36_27b"), "null or 'qwen36_27b'"),
                  ("data", len(self.data) >= 1, "at least one collect output folder"),
                  ("steps", self.steps >= 1, ">= 1"), ("micro_batch", self.micro_batch >= 1, ">= 1"),
                  ("grad_accum", self.grad_accum >= 1, ">= 1"), ("lr", self.lr > 0, "> 0"),
                  ("zero_stage", self.zero_stage in (0, 1, 2), "0, 1 or 2 (ZeRO stage 3 partitions the weights "
                   "across ranks, and evaluation and saving run on rank 0 with the whole model; the models trained "
                   "here fit on one device, and stage 2 already partitions the gradients and optimizer state)"),
                  ("max_bad_steps", self.max_bad_steps >= 1, ">= 1"),
                  ("heldout_fraction", 0 < self.heldout_fraction < 1, "in (0, 1)"),
                  ("eval_every", self.eval_every >= 1, ">= 1"), ("checkpoint_every", self.checkpoint_every >= 1, ">= 1"),
                  ("keep_last", self.keep_last >= 1, ">= 1"), ("block_size", self.block_size >= 2, ">= 2"),
                  ("anchors_per_sequence", self.anchors_per_sequence >= 1, ">= 1"),
                  ("eval_budgets", all(b >= 1 for b in self.eval_budgets), "budgets >= 1"),
                  ("depth_gamma", self.depth_gamma is None or self.depth_gamma > 0, "null or > 0"),
                  ("compile", self.compile in ("auto", "on", "off"), "'auto', 'on' or 'off'"),
                  ("score_group_rows", self.score_group_rows >= 0, ">= 0")]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"train config: {name} must be {expected}, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return cls(**checked_fields(cls, d, "train config"))

    @classmethod
    def load(cls, path: str) -> TrainConfig:
        return cls.from_dict(load_mapping(path, "train config"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def trajectory_settings(self) -> dict:
        """The settings that change the trajectory (not evaluation, checkpointing, logging, paths or speed)."""
        d = self.to_dict()
        for k in ("output_dir", "eval_every", "eval_rows", "eval_budgets", "checkpoint_every", "keep_last",
                  "log_every", "device", "compile", "score_group_rows", "allow_incomplete_data", "max_bad_steps"):
            d.pop(k)
        return d

    def run_hash(self, data_fingerprint: str = "") -> str:
        """Hash of the trajectory settings and the data (`data_fingerprint`: the shards' sha256, see
        data.data_fingerprint): a run folder only resumes under the same hash."""
        d = {**self.trajectory_settings(), "data_fingerprint": data_fingerprint}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def deepspeed_config(self, world_size: int, bf16: bool) -> dict:
        """The DeepSpeed config built from the few settings that matter here (optimizer and schedule are ours)."""
        from pipelines.train.optim import owns_clipping
        own = owns_clipping(self.zero_stage)
        return {"train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.grad_accum,
                "train_batch_size": self.micro_batch * self.grad_accum * world_size,
                # ZeRO 1/2: the optimizer clips on the device (pipelines/train/optim.py; DeepSpeed's clipping reads
                # the norm back twice a step), so DeepSpeed neither clips nor computes the norm, and accepts the
                # AdamW subclass
                "gradient_clipping": 0.0 if own else self.grad_clip,
                "zero_optimization": {"stage": self.zero_stage, **({"compute_grad_norm": False} if own else {})},
                **({"zero_allow_untested_optimizer": True} if own else {}),
                # bf16 cannot overflow where fp32 does not; DeepSpeed's per-parameter inf/nan scan (~400 small
                # launches and a host sync per step) is replaced by the loop's check of the loss and grad norm
                "bf16": {"enabled": bf16, "check_grad_overflow": False},
                # DeepSpeed's throughput timer synchronizes the device at every forward and step (two host
                # syncs per step: the GPU idles while the host issues the next kernels); the loop times itself
                "timers": {"throughput": {"enabled": False}},
                "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
