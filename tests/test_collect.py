"""Collect without a cluster: input handling, bad input, shard encoding and validation, featurization."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.collect.__main__ import main as collect_main
from pipelines.collect.__main__ import run
from pipelines.collect.config import CollectConfig
from pipelines.collect.features import concat_rows, featurize, featurize_batch, sample_anchors, token_batches
from pipelines.collect.inputs import Sample, list_input_files, read_records, tokenize
from pipelines.collect.models import check_pair, load_models
from pipelines.shards import anchor_columns, column, decode_bf16, encode_bf16, to_table, validate, write_shard
from tfm_runtime.contract import ContractError
from tfm_runtime.worlds import tiny_tokenizer


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def config(tmp_path, inputs, **kw):
    base = dict(target="tiny:llama:0", drafter="tiny:llama:0", inputs=inputs, output_dir=str(tmp_path / "out"),
                max_new_tokens=8, anchors_per_sequence=3, candidate_pool=16, target_topk=4, samples_per_shard=4,
                max_prompt_tokens=40)
    base.update(kw)
    return CollectConfig(**base)


def test_tokenize_counts_skips_and_uses_render_boundary(tmp_path):
    f = jsonl(tmp_path / "in.jsonl", [
        {"prompt": "hello"}, {"prompt": "  "}, {"prompt": "x" * 200}, {"other": 1},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hey!"}]},
        {"messages": [{"role": "assistant", "content": "no user"}]}])
    tok = tiny_tokenizer()
    samples, skipped = tokenize(read_records(list_input_files([f])), tok, prompt_field="prompt", response="keep",
                                max_prompt_tokens=40)
    assert dict(skipped) == {"empty_prompt": 1, "prompt_too_long": 1, "malformed_record": 1, "no_user_turn": 1,
                             "no_response_to_keep": 1}
    assert [s.sample_id for s in samples] == [4]
    s = samples[0]
    assert tok.decode(s.response_ids) == "hey!<|im_end|>\n"
    assert tok.decode(s.prompt_ids).endswith("<|im_start|>assistant\n")


def test_prompt_turn_last_answers_the_final_user_turn_of_a_multi_turn_context(tmp_path):
    conv = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "second"}]
    f = jsonl(tmp_path / "in.jsonl", [{"messages": conv}, {"messages": conv + [{"role": "assistant", "content": "two"}]}])
    tok = tiny_tokenizer()
    recs = read_records(list_input_files([f]))
    first, _ = tokenize(recs, tok, prompt_field="prompt", response="regenerate", max_prompt_tokens=100)
    last, _ = tokenize(recs, tok, prompt_field="prompt", response="regenerate", max_prompt_tokens=100,
                       prompt_turn="last")
    assert tok.decode(first[0].prompt_ids).count("<|im_start|>user") == 1
    text = tok.decode(last[0].prompt_ids)
    assert text.count("<|im_start|>user") == 2 and "one<|im_end|>" in text and text.endswith("assistant\n")
    kept, _ = tokenize(recs, tok, prompt_field="prompt", response="keep", max_prompt_tokens=100, prompt_turn="last")
    assert [s.sample_id for s in kept] == [1] and tok.decode(kept[0].response_ids) == "two<|im_end|>\n"
    with pytest.raises(ValueError, match="prompt_turn"):
        config(tmp_path, [f], prompt_turn="middle")


def test_malformed_json_line_fails_before_any_work(tmp_path):
    f = jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, '{"prompt": "unterminated', {"prompt": "ok"}])
    cfg = config(tmp_path, [f])
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        run(cfg, progress=False)
    assert not os.path.exists(cfg.output_dir)


def test_missing_inputs_and_models_fail_clearly(tmp_path):
    f = jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(config(tmp_path, [str(tmp_path / "nope.jsonl")]), progress=False)
    with pytest.raises(FileNotFoundError, match="target model"):
        run(config(tmp_path, [f], target=str(tmp_path / "no" / "model")), progress=False)
    with pytest.raises(FileNotFoundError, match="drafter"):
        run(config(tmp_path, [f], drafter=str(tmp_path / "no_drafter")), progress=False)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("field,value,match", [("vocab_size", 300, "vocab_size"), ("hidden_size", 32,
                                               "target_hidden_size"), ("target_layer_ids", [1, 9], "tap_layer_ids")])
def test_incompatible_drafter_fails_before_any_work(tmp_path, field, value, match):
    from tfm_runtime.worlds import tiny_world
    d = tiny_world("llama", vocab_size=262).drafter
    hf = d.cfg.to_hf_dict()
    if field == "target_layer_ids":
        hf["dflash_config"]["target_layer_ids"] = value
    else:
        hf[field] = value
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(hf))
    f = jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}])
    cfg = config(tmp_path, [f], drafter=str(tmp_path / "drafter"))
    with pytest.raises(ContractError, match=match):
        run(cfg, progress=False)
    assert not os.path.exists(cfg.output_dir)
    assert collect_main(["--config", _dump(tmp_path, cfg)]) == 2         # the CLI says why and exits 2


def _dump(tmp_path, cfg):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(cfg.to_dict()))
    return str(p)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        CollectConfig.from_dict({"target": "t", "drafter": "d", "inputs": ["x"], "output_dir": "o", "bogus": 1})
    with pytest.raises(ValueError, match="missing required keys"):
        CollectConfig.from_dict({"target": "t"})
    with pytest.raises(ValueError, match="drafter is required"):
        CollectConfig.from_dict({"target": "t", "inputs": ["x"], "output_dir": "o"})
    assert CollectConfig.from_dict({"target": "t", "inputs": ["x"], "output_dir": "o", "text_only": True}).drafter is None
    with pytest.raises(ValueError, match="response must be"):
        config(tmp_path, ["x"], response="rewrite")
    a, b = config(tmp_path, ["x"]), config(tmp_path, ["x"], num_actors=4, output_dir="/elsewhere")
    assert a.data_hash() == b.data_hash() != config(tmp_path, ["x"], seed=1).data_hash()


def test_bf16_encoding_round_trip():
    x = np.array([0.0, -1.5, 3.140625, 1e-3, 65504.0, -1e30], dtype=np.float32)
    y = decode_bf16(encode_bf16(x))
    np.testing.assert_allclose(y, x, rtol=2 ** -8)
    assert y[1] == -1.5 and y[2] == 3.140625                 # exactly representable values survive


def test_featurize_rows_are_aligned_and_round_trip(tmp_path):
    cfg = config(tmp_path, ["x"])
    target, drafter = load_models(cfg, torch.device("cpu"))
    tok = tiny_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "count"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    s = Sample(7, prompt, [100, 101, 102, 103, 104, 105, 258])
    rows = featurize(target, drafter, s, anchors_per_sequence=3, candidate_pool=16, target_topk=4, seed=0)
    L, H = drafter.lookahead, target.hidden_size
    seq = s.prompt_ids + s.response_ids
    validate(rows, {7: seq}, target.vocab_size)
    cols = anchor_columns(L, H, 16, 4)
    table = to_table(rows, cols, {"contract": check_pair(cfg).to_dict()})
    facts = write_shard(table, str(tmp_path / "s.parquet"))
    back = pq.read_table(tmp_path / "s.parquet")
    assert facts["rows"] == back.num_rows == 3
    for name, (dt, shape) in cols.items():
        got = column(back, name)
        assert got.shape == (3, *shape)
        tol = dict(rtol=2 ** -7, atol=1e-6) if dt == "bf16" else dict(rtol=0, atol=0)
        np.testing.assert_allclose(got.astype(np.float64), rows[name].astype(np.float64), **tol)
    assert (rows["anchor_pos"] >= len(prompt)).all()
    bad = dict(rows)
    bad["true_tokens"] = rows["true_tokens"].copy()
    bad["true_tokens"][0, 0] += 1
    with pytest.raises(ValueError, match="misaligned"):
        validate(bad, {7: seq}, target.vocab_size)
    bad = dict(rows, h_final=rows["h_final"].copy())
    bad["h_final"][1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        validate(bad, {7: seq}, target.vocab_size)


def test_batched_featurize_equals_one_sequence_at_a_time(tmp_path):
    """Right-padded batches (several groups, padding after short sequences) give each sequence's own rows."""
    cfg = config(tmp_path, ["x"])
    target, drafter = load_models(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    samples = [Sample(i, torch.randint(0, 250, (p,), generator=gen).tolist(),
                      torch.randint(0, 250, (r,), generator=gen).tolist())
               for i, (p, r) in enumerate([(5, 30), (12, 4), (3, 60), (20, 1), (8, 17)])]
    kw = dict(anchors_per_sequence=4, candidate_pool=16, target_topk=4, seed=0)
    one = concat_rows([featurize(target, drafter, s, **kw) for s in samples])
    batched = featurize_batch(target, drafter, samples, max_tokens=80, topk_chunk=3, **kw)
    assert token_batches([35, 16, 63, 21, 25], 80) == [[0, 1], [2], [3, 4]]
    assert set(one) == set(batched) and len(one["sample_id"]) == 4 + 3 + 4 + 0 + 4
    for name in one:
        if one[name].dtype.kind == "f":
            np.testing.assert_allclose(batched[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(batched[name], one[name], err_msg=name)


def test_anchor_sampling_is_deterministic_and_in_range():
    a = sample_anchors(10, 30, 5, np.random.default_rng([0, 3]))
    b = sample_anchors(10, 30, 5, np.random.default_rng([0, 3]))
    assert (a == b).all() and len(set(a.tolist())) == 5 and a.min() >= 10 and a.max() <= 28
    assert sample_anchors(10, 11, 5, np.random.default_rng(0)).size == 0
    assert sample_anchors(3, 6, 9, np.random.default_rng(0)).tolist() == [3, 4]
