"""The transformers model for an export, rebuilt from the export's own config and weights
(same dtype, same values: quantized weights dequantized as nxdc's kernels read them), so
`--compare transformers` needs nothing but the export dir."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from nxdc.archs import get_arch
from nxdc.compile.trace import meta_decoder
from nxdc.errors import UserInputError
from nxdc.manifest import Manifest
from nxdc.model.decoder import TIED
from nxdc.model.dtypes import TORCH_DTYPES
from nxdc.model.fused import unfuse_state_dict
from nxdc.model.layers import dequantized


def transformers_model(export_dir: Path, manifest: Manifest):
    from transformers import AutoConfig, AutoModelForCausalLM

    plan = manifest.plan
    if plan.tp != 1:
        raise UserInputError(f"--compare transformers needs a --tp 1 export ({export_dir} is tp {plan.tp})")
    dtype = TORCH_DTYPES[plan.dtype]
    cfg = AutoConfig.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ours = load_file(str(Path(export_dir) / "weights" / manifest.rank_weights(0).path))
    meta = meta_decoder(manifest.spec, plan)
    ours = unfuse_state_dict(dequantized_state(ours, meta, dtype), meta)
    arch = get_arch(manifest.spec.arch)
    state = {arch.hf_name(k): v for k, v in ours.items()}
    result = model.load_state_dict(state, strict=False)
    tied = {arch.hf_name(k) for k in TIED} if cfg.tie_word_embeddings else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UserInputError(
            f"cannot rebuild the transformers model from {export_dir}: "
            f"{len(missing)} missing weights, e.g. {missing[:2]}; unexpected: {result.unexpected_keys[:2]}"
        )
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(plan.device)  # the export's device: same hardware both sides


def dequantized_state(state: dict[str, torch.Tensor], meta, dtype) -> dict[str, torch.Tensor]:
    """A stored state with every quantized weight (``--weights int8 / int4 / auto``) replaced by
    its values in ``dtype``, as nxdc's kernels compute with them: transformers then runs the
    very numbers the export holds."""
    for name, module in meta.named_modules():
        fmt = getattr(module, "fmt", None)
        if fmt is not None and fmt.quantized and f"{name}.weight" in state:
            scale, mins = state.pop(f"{name}.scale"), state.pop(f"{name}.min", None)
            state[f"{name}.weight"] = dequantized(state[f"{name}.weight"], fmt, scale, mins, dtype)
    return state


def transformers_generate(model, ids: list[list[int]], new_tokens: int) -> dict:
    """TTFT (a 1-token generate) and decode rate (tokens after the first) of eager generate."""
    import time

    x = torch.tensor(ids, device=model.device)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t
    decode = max(total - ttft, 1e-9)
    return {"ttft_s": ttft, "decode_tokens_per_s": (new_tokens - 1) * len(ids) / decode, "e2e_s": total}
