"""LoRA policies (trainer/lora.py): only adapters train, and the merged weights reach vLLM by base names.

The engine: vLLM allows one engine per process here (a second one fails its memory check), so
when another collected test starts the session's micro engine anyway (conftest `vllm_engine`,
started before bm25s) we reuse it and its policy as the base; run alone, this file serves a
fresh tiny random Qwen2 instead (seconds, not the minutes of building the micro world).
"""

import copy

import pytest
import torch
from numerics import assert_close, assert_equal_bits, logit_atol, logprob_atol

from tiny.sft import build_tiny_model, train_tokenizer
from trainer.batching import token_logprobs
from trainer.config import ModelConfig, RolloutConfig
from trainer.engine import load_policy, make_engine
from trainer.lora import add_lora, base_name, load_lora, merge_and_save, merged_weights

pytestmark = pytest.mark.numeric  # LoRA logits and vLLM logprobs against the plain model's

TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """(vLLM engine, base model directory); the engine serves that directory's weights."""
    if any("vllm_engine" in item.fixturenames for item in request.session.items):
        return request.getfixturevalue("vllm_engine"), request.getfixturevalue("micro")[2]
    path = tmp_path_factory.mktemp("lora_base")
    tok = train_tokenizer(["Where was Ka Bo born? <search> Ka Bo </search> Paris"] * 8, 300, path)
    torch.manual_seed(0)
    mcfg = ModelConfig(hidden_size=128, num_heads=2, num_layers=2, intermediate_size=256)
    build_tiny_model(mcfg, tok).save_pretrained(path)
    rollout = RolloutConfig(max_model_len=256, gpu_memory_utilization=0.05, enforce_eager=True)  # as conftest.MICRO
    return make_engine("vllm", path, rollout), path


@pytest.fixture
def trained(served):
    """(base model, LoRA model after two AdamW steps so B != 0, token ids, attention mask).
    Fresh per test: once merged and unmerged in place, weights can be off by rounding, and a
    second merge/unmerge round trip is then often exact, which would hide that from later tests."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 24))
    attn = torch.ones_like(ids)
    model = add_lora(load_policy(served[1]), rank=4, alpha=8.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(2):
        opt.zero_grad()
        (-token_logprobs(model, ids, attn).sum()).backward()
        opt.step()
    return load_policy(served[1]).eval(), model.eval(), ids, attn


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_only_adapters_train_and_start_as_the_base(served):
    base = load_policy(served[1])
    model = add_lora(copy.deepcopy(base), rank=4, alpha=8.0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * len(TARGETS) * layers  # lora_A and lora_B of every projection
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == TARGETS
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():  # B starts at zero: same function as the base, bit for bit (the adapter adds exact 0s)
        assert_equal_bits(model(input_ids=ids).logits, base(input_ids=ids).logits, what="logits at B = 0")


def test_merged_weights_are_peft_merge_under_base_names(trained):
    base, model, _, _ = trained
    pairs = list(merged_weights(model))
    assert [n for n, _ in pairs] == list(base.state_dict())  # names and order, tied included
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(reference) == [n for n, _ in pairs]
    changed = set()
    for name, tensor in pairs:
        assert_equal_bits(tensor, reference[name], what=name)  # exact: peft's merge, the same ops in place
        if not torch.equal(tensor, base.state_dict()[name]):
            changed.add(name)
    # exactly the weights of the adapted projections differ from the base: B != 0 after training
    assert changed == {n for n in base.state_dict() if n.split(".")[-2] in TARGETS and n.endswith("weight")}


def test_the_policy_is_untouched_by_a_sync_even_if_the_consumer_fails(trained):
    _, model, ids, attn = trained
    before, logits = params(model), model(input_ids=ids).logits.detach()
    list(merged_weights(model))
    with pytest.raises(KeyError):  # a consumer that stops half-way with an error
        for i, (name, _) in enumerate(merged_weights(model)):
            if i == 10:
                raise KeyError(name)
    after = params(model)
    # exact: merged_weights only reads the model, so the same weights and the same kernels
    assert_equal_bits(after, before, what="parameters after a sync")
    assert_equal_bits(model(input_ids=ids).logits, logits, what="logits after a sync")
    # still trainable: a step moves the adapters (and only them)
    model.train()
    (-token_logprobs(model, ids, attn).sum()).backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    model.zero_grad()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


def test_refuses_a_model_with_merged_adapters(trained):
    model = trained[1]
    model.merge_adapter()  # merged in place: adding the deltas again would double them
    with pytest.raises(RuntimeError, match="merged adapters"):
        next(merged_weights(model))
    assert base_name("base_model.model.lm_head.weight") == "lm_head.weight"


def test_vllm_serves_the_merged_policy_after_sync(served, trained):
    engine, path = served
    base, model, ids, attn = trained
    with torch.no_grad():
        want = token_logprobs(model, ids, attn)[0].tolist()
        base_lp = token_logprobs(base, ids, attn)[0].tolist()
    lp = logprob_atol(base.config.vocab_size)  # vLLM's kernels vs torch's, the same fp32 weights
    assert max(abs(a - b) for a, b in zip(want, base_lp)) > 10 * lp  # the adapters matter, by far more than rounding
    seq = ids[0].tolist()
    assert_close(engine.score(seq), base_lp, rtol=0, atol=lp, what="engine vs base")  # serving the base so far
    try:
        engine.load_weights(merged_weights(model))
        assert_close(engine.score(seq), want, rtol=0, atol=lp, what="engine vs LoRA policy")
    finally:
        engine.load_weights(base.state_dict().items())  # the session engine serves the base again
    assert_close(engine.score(seq), base_lp, rtol=0, atol=lp, what="engine vs base again")


def test_merge_and_save_writes_a_plain_policy_and_the_adapters(served, trained, tmp_path):
    _, model, ids, _ = trained
    out = merge_and_save(model, tmp_path / "merged")
    plain = load_policy(out)
    assert not any("lora" in n for n in plain.state_dict())
    with torch.no_grad():
        want = model(input_ids=ids).logits
        # merged W + s B A (one rounding per weight) vs x W + s (x A) B: the sums regrouped
        assert_close(plain(input_ids=ids).logits, want, rtol=0, atol=logit_atol(), what="merged vs LoRA logits")
        back = load_lora(load_policy(served[1]), out)  # exact resume: the base + the saved adapters
        # exact: safetensors keeps the bits, and the same modules run the same kernels on them
        assert_equal_bits(back(input_ids=ids).logits, want, what="reloaded LoRA logits")
    assert {n for n, p in back.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
