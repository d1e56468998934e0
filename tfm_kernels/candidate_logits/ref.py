"""float64 reference for candidate logits: gather the candidate LM-head rows, matvec, log-softmax."""
import math

import torch


def candidate_logits_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    cand: torch.Tensor,
    inv_temperature: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidate logits and their log-softmax over the valid candidates of each row, in float64.

    Args:
        hidden: [M, Dm]; weight: [Vocab, Dm]; cand: int [M, Kc] (negative = pad, as are ids >= Vocab);
        inv_temperature: None, a float or [M]; bias: [M, Kc] or None, added after the temperature.
    Returns:
        logits, logprobs: float64 [M, Kc] (-inf at pads); lse: float64 [M] (-inf for an all-pad row).
        Duplicate ids are separate entries: each copy gets the same logit and all copies count in
        the normaliser.
    """
    V = weight.shape[0]
    valid = (cand >= 0) & (cand < V)
    Wc = weight[torch.where(valid, cand, 0).long()].double()  # [M, Kc, Dm]
    logits = (Wc @ hidden.double()[..., None])[..., 0]
    if inv_temperature is not None:
        inv = torch.as_tensor(inv_temperature, dtype=torch.float64, device=hidden.device)
        logits = logits * (inv[:, None] if inv.dim() == 1 else inv)
    if bias is not None:
        logits = logits + bias.double()
    logits = logits.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(logits, -1)
    logprobs = torch.where(valid, logits - lse[:, None], torch.full_like(logits, -math.inf))
    return logits, logprobs, lse


def candidate_logits_full_head(hidden, weight, cand, inv_temperature=None, bias=None):
    """Same function through the full LM head: `hidden @ weight.T`, then gather and log-softmax.

    The cross-check of the spec and the "full head" benchmark baseline (runs in the input dtype).
    """
    V = weight.shape[0]
    valid = (cand >= 0) & (cand < V)
    full = (hidden @ weight.T).float()  # [M, Vocab]
    logits = torch.gather(full, 1, torch.where(valid, cand, 0).long())
    return _finish(logits, valid, inv_temperature, bias)


def candidate_logits_gather(hidden, weight, cand, inv_temperature=None, bias=None):
    """`weight[cand]` materialised + bmm + log-softmax (the "gather" benchmark baseline)."""
    V = weight.shape[0]
    valid = (cand >= 0) & (cand < V)
    Wc = weight[torch.where(valid, cand, 0).long()]  # [M, Kc, Dm]
    logits = torch.bmm(Wc, hidden[:, :, None]).float()[..., 0]
    return _finish(logits, valid, inv_temperature, bias)


def _finish(logits, valid, inv_temperature, bias):
    """Temperature, bias, padding mask and log-softmax, shared by the torch baselines."""
    if inv_temperature is not None:
        inv = torch.as_tensor(inv_temperature, dtype=torch.float32, device=logits.device)
        logits = logits * (inv[:, None] if inv.dim() == 1 else inv)
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~valid, -math.inf)
    return logits, torch.log_softmax(logits, -1)
