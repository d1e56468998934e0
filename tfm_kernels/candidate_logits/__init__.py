from tfm_kernels.candidate_logits.grad import candidate_log_probs
from tfm_kernels.candidate_logits.ref import candidate_logits_ref
from tfm_kernels.candidate_logits.triton import CandidateTuning, candidate_logits

__all__ = ["CandidateTuning", "candidate_log_probs", "candidate_logits", "candidate_logits_ref"]
