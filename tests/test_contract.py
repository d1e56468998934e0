import dataclasses

import pytest

from tfm_runtime.contract import Contract, ContractError, check_compatible, tokenizer_hash


def make(**kw):
    base = dict(target_id="Qwen/Qwen3-8B", target_revision="abc", drafter_id="z-lab/Qwen3-8B-DFlash-b16",
                drafter_revision=None, vocab_size=151936, target_hidden_size=4096, drafter_hidden_size=4096,
                tap_layer_ids=[1, 9, 17, 25, 33], block_size=16, mask_token_id=151669, candidate_pool=512,
                lookahead=15, tokenizer_hash="deadbeef")
    base.update(kw)
    return Contract(**base)


def test_json_round_trip(tmp_path):
    c = make()
    assert Contract.from_json(c.to_json()) == c
    p = tmp_path / "contract.json"
    c.save(p)
    assert Contract.load(p) == c
    assert c.tap_layer_ids == (1, 9, 17, 25, 33)
    assert c.hash() == Contract.load(p).hash()


@pytest.mark.parametrize("name,value", [("vocab_size", 151937), ("target_hidden_size", 5120),
                                        ("drafter_hidden_size", 2048), ("tap_layer_ids", (1, 9, 17, 25, 34)),
                                        ("block_size", 32), ("mask_token_id", 0), ("candidate_pool", 256),
                                        ("lookahead", 7), ("tokenizer_hash", "cafe"), ("shard_schema_version", 2)])
def test_mismatch_names_field(name, value):
    a = make()
    b = dataclasses.replace(a, **{name: value})
    with pytest.raises(ContractError) as e:
        check_compatible(a, b)
    assert e.value.field == name and e.value.actual == value
    assert name in str(e.value) and repr(value) in str(e.value)


def test_ids_only_checked_when_strict():
    a, b = make(), make(target_id="/local/copy")
    check_compatible(a, b)
    with pytest.raises(ContractError, match="target_id"):
        check_compatible(a, b, strict_ids=True)


def test_unknown_tokenizer_hash_is_not_compared():
    check_compatible(make(), make(tokenizer_hash=None))


def test_invalid_values_rejected():
    with pytest.raises(ContractError, match="lookahead"):
        make(lookahead=16)
    with pytest.raises(ContractError, match="candidate_pool"):
        make(candidate_pool=0)
    with pytest.raises(ContractError, match="mask_token_id"):
        make(mask_token_id=151936)


def test_bad_dicts_rejected():
    d = make().to_dict()
    with pytest.raises(ValueError, match="unknown contract fields"):
        Contract.from_dict({**d, "bogus": 1})
    d.pop("vocab_size")
    with pytest.raises(ValueError, match="vocab_size"):
        Contract.from_dict(d)


def test_tokenizer_hash_stable_and_sensitive():
    class Tok:
        def __init__(self, v):
            self.v = v
            self.all_special_tokens = ["<eos>"]

        def get_vocab(self):
            return dict(self.v)
    a, b = Tok({"a": 0, "b": 1}), Tok({"b": 1, "a": 0})
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert tokenizer_hash(a) != tokenizer_hash(Tok({"a": 1, "b": 0}))
