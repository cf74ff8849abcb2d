"""LoRA policies: train low-rank adapters, keep serving the full base model from vLLM.

What: `add_lora` wraps a causal LM in peft LoRA adapters (only the adapters train);
`merged_weights` yields the weights the policy really computes with (base + B @ A * scale)
under the plain base-model names, for `engine.load_weights`; `merge_and_save` writes them as a
plain Hugging Face directory (for eval.py or a vLLM restart).

Why: the rollout engine loaded the base model by its own names (`model.layers.0.mlp.up_proj.
weight`) and knows nothing of adapters. After each update it needs the merged weights under
exactly those names: peft's names (`base_model.model.` prefix, `.base_layer`, `lora_A/B`)
would be rejected or, worse, silently skipped, and vLLM would keep sampling from the base.

How: merge out of place, layer by layer: for each base state-dict entry yield the parameter
itself (a view) or a new tensor `W + B @ A * scale` for an adapted weight. The model is only
read, so there is nothing to unmerge and its weights stay bit-identical whatever the consumer
does (raise, stop early, or keep the tensors past the generator's end, as VLLMEngine.
load_weights does: an in-place merge_adapter() ... finally: unmerge_adapter() would then push
the unmerged base, since the kept tensors are views of weights already unmerged).

    model = add_lora(load_policy(path), rank=16, alpha=32)    # peft model, adapters trainable
    ...optimizer over (p for p in model.parameters() if p.requires_grad)...
    engine.load_weights(merged_weights(model))                # vLLM now samples the new policy
    merge_and_save(model, run / "merged")                     # plain HF dir, no peft needed
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

# The attention and MLP projections of Qwen2 / Llama / Mistral style decoders.
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Name parts peft adds around the base model's own names.
PEFT_PREFIX = "base_model.model."
LORA_PARTS = ("lora_", "modules_to_save", "original_module")
LORA_DIR = "lora"  # merge_and_save's subdirectory holding the adapters alone


def add_lora(model, rank: int, alpha: float, dropout: float = 0.0, targets: list[str] | None = None):
    """Wrap `model` in LoRA adapters; only the adapters require grad (B starts at zero, so the
    wrapped model computes exactly what the base did).

    >>> m = add_lora(Qwen2ForCausalLM(cfg), rank=8, alpha=16)         # doctest: +SKIP
    >>> sorted({n.split(".")[-3] for n, p in m.named_parameters() if p.requires_grad})  # doctest: +SKIP
    ['lora_A', 'lora_B']
    """
    from peft import LoraConfig, get_peft_model

    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    cfg = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
        target_modules=list(targets or DEFAULT_TARGETS),
    )  # fmt: skip
    return get_peft_model(model, cfg)


def base_name(name: str) -> str:
    """A peft parameter name as the plain base model spells it.

    >>> base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> base_name("model.embed_tokens.weight")
    'model.embed_tokens.weight'
    """
    name = name.removeprefix(PEFT_PREFIX)
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _lora_layers(peft_model) -> dict[str, torch.nn.Module]:
    """{peft module name: LoRA layer} for every adapted layer, refusing what we cannot merge."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            for a in module.active_adapters:
                if a in getattr(module, "lora_variant", {}) or module.lora_bias.get(a, False):
                    raise NotImplementedError(f"{name}: DoRA/variants and lora_bias are not merged here")
            if module.merged:
                raise RuntimeError(f"{name} has merged adapters (merge_adapter()); unmerge first")
            layers[name] = module
    return layers


@torch.no_grad()
def merged_weights(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, tensor) for every entry of the base model's state dict, adapters merged in.

    Names and order are those of the plain model's `state_dict()` (tied weights under both
    names, as there); LoRA factors are not yielded. The model is only read (see module doc).

    >>> names = [n for n, _ in merged_weights(add_lora(base, 4, 8))]   # doctest: +SKIP
    >>> names == list(base_state_dict_names)                            # doctest: +SKIP
    True
    """
    layers = _lora_layers(peft_model)
    for name, tensor in peft_model.state_dict(keep_vars=True).items():
        if any(part.startswith(LORA_PARTS) for part in name.split(".")):
            if "modules_to_save" in name or "original_module" in name:
                raise NotImplementedError(f"{name}: modules_to_save is not supported")
            continue
        tensor = tensor.detach()
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner)
        if layer is not None and leaf == "weight" and not layer.disable_adapters:
            merged = tensor.clone()
            for a in layer.active_adapters:
                if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {}):
                    merged += layer.get_delta_weight(a)  # in place, as peft's merge: same rounding
            tensor = merged
        yield base_name(name), tensor


def merge_and_save(peft_model, out_dir: str | Path, tokenizer=None) -> Path:
    """Write the merged policy as a plain Hugging Face directory (config + safetensors), which
    `engine.load_policy` / `make_engine` / eval.py load without peft, and the adapters alone
    under `out_dir/lora` (peft format) for an exact resume with `load_lora`.

    >>> merge_and_save(model, "runs/x/merged", tokenizer)              # doctest: +SKIP
    PosixPath('runs/x/merged')
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = peft_model.get_base_model()
    state, seen = {}, set()
    for name, tensor in merged_weights(peft_model):
        key = (tensor.data_ptr(), tensor.shape)
        if key in seen:  # a tied weight: save it once, like save_pretrained does
            continue
        seen.add(key)
        state[name] = tensor.contiguous().cpu()
    base.config.save_pretrained(out)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    peft_model.save_pretrained(out / LORA_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_lora(model, adapter_dir: str | Path):
    """The base `model` with trainable adapters read back from `merge_and_save`'s output (give
    the directory or its `lora` subdirectory). The base must be the one they were trained on.

    >>> m = load_lora(load_policy(start_dir), "runs/x/checkpoints/step_10")  # doctest: +SKIP
    """
    from peft import PeftModel

    path = Path(adapter_dir)
    path = path / LORA_DIR if (path / LORA_DIR).is_dir() else path
    return PeftModel.from_pretrained(model, str(path), is_trainable=True)
