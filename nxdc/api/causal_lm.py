"""``nxdc.NxdcModelForCausalLM``: an export behind transformers' ``generate``, for code written
against ``AutoModelForCausalLM`` (as optimum-neuron's ``NeuronModelForCausalLM`` is).

    model = nxdc.NxdcModelForCausalLM.from_pretrained("exports/smol")
    inputs = tokenizer(["Hello", "Once upon a time"], return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)

What transformers does, for what it implements: the prompt and new tokens in one
``LongTensor``, rows that ended early padded with ``pad_token_id`` (default: the first EOS id),
the EOS token kept; a left-padded batch with its ``attention_mask`` gives each row what it gives
alone; a ``streamer`` (``TextStreamer``) gets the prompt, then each step's tokens, then ``end()``;
parameters from the ``generation_config`` given, else from the export's
``generation_config.json``, overridden by keyword arguments. What it does not implement (beam
search, repetition penalties, logits processors, ...) is refused, naming it."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

from nxdc.api.model import GenerateOptions, Model, PathLike, load
from nxdc.errors import UserInputError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("nxdc")

# transformers' defaults where a generation config leaves a value unset (None)
DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

# GenerationConfig fields nxdc does not implement -> the value that means "off"
NOT_IMPLEMENTED: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "sequence_bias": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "top_h": None,
    "diversity_penalty": 0.0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "dola_layers": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "max_time": None,
    "token_healing": False,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
}


class NxdcModelForCausalLM:
    """An nxdc export with transformers' ``generate`` (greedy and temperature / top-k / top-p
    sampling). Load it with ``from_pretrained(export_dir)``; ``model`` is the ``nxdc.Model``
    underneath, ``config`` / ``generation_config`` the export's transformers configs. Close it
    (or use it as a context manager) to stop the worker processes of a --tp export."""

    main_input_name = "input_ids"

    def __init__(self, model: Model):
        from transformers import AutoConfig, GenerationConfig

        self.model = model
        self.config = AutoConfig.from_pretrained(model.export_dir)
        try:
            self.generation_config = GenerationConfig.from_pretrained(model.export_dir)
        except OSError:  # the export has no generation_config.json
            self.generation_config = GenerationConfig.from_model_config(self.config)

    @classmethod
    def from_pretrained(
        cls, export_dir: PathLike, *, threads: int | None = None, **kwargs
    ) -> NxdcModelForCausalLM:
        """Load an export directory (written by ``nxdc export``; not a Hugging Face checkpoint:
        export that first). ``threads`` as for ``nxdc.load``. Its dtype and device were chosen
        at export, so transformers' loading options (``torch_dtype``, ``device_map``, ...) are
        refused rather than ignored."""
        if kwargs:
            raise UserInputError(
                f"from_pretrained: {', '.join(sorted(kwargs))} not taken: an nxdc export's dtype, "
                "device and weights are fixed when it is exported (nxdc export)"
            )
        return cls(load(export_dir, threads=threads))

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")  # where it takes input_ids and returns tokens

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config=None,
        streamer=None,
        **kwargs,
    ) -> torch.LongTensor:
        """transformers' ``generate`` for a decoder: ``input_ids`` [batch, length] (at most the
        export's batch size; left-padded with an ``attention_mask`` for prompts of different
        lengths) -> [batch, length + new] token ids.

        Takes ``max_new_tokens`` (or ``max_length``, default 20 in all), ``do_sample``,
        ``temperature``, ``top_k`` (default 50), ``top_p``, ``eos_token_id``, ``pad_token_id``,
        ``stop_strings`` as keyword arguments or in ``generation_config``; a sampling seed comes
        from torch's global generator, so ``torch.manual_seed`` makes it reproducible (not the
        same draws as transformers). Generation also stops at the export's sequence length
        (a warning on the ``nxdc`` logger says so). Anything else transformers' ``generate``
        takes raises ``UserInputError`` naming it."""
        import torch

        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        kwargs.pop("tokenizer", None)  # transformers needs it for stop_strings; nxdc has its own
        gen = self._generation_config(generation_config, kwargs)
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.dtype.is_floating_point:
            raise UserInputError(
                f"input_ids must be token ids of shape [batch, length] (got {tuple(ids.shape)})"
            )
        eos = _id_list(gen.eos_token_id)
        pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if eos else None)
        mask = _attention_mask(ids, attention_mask, pad, eos)
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        max_new = (
            gen.max_new_tokens if gen.max_new_tokens is not None else _get(gen, "max_length") - ids.shape[1]
        )
        do_sample = bool(_get(gen, "do_sample"))
        opts = GenerateOptions(
            max_new_tokens=max_new,
            do_sample=do_sample,
            temperature=_get(gen, "temperature"),
            top_k=_get(gen, "top_k") or 0,
            top_p=_get(gen, "top_p"),
            seed=int(torch.randint(0, 2**62, ())) if do_sample else None,
            stop=gen.stop_strings or (),
        )
        steps = self.model._start(rows, opts, eos_ids=set(eos))
        if streamer is not None:
            streamer.put(ids.cpu())
        fill = pad if pad is not None else 0
        new = _run(steps, len(rows), fill, streamer, self.model.sequence_length)
        out = torch.full((len(rows), max(len(n) for n in new)), fill, dtype=torch.long)
        for i, n in enumerate(new):
            out[i, : len(n)] = torch.tensor(n, dtype=torch.long)
        return torch.cat([ids.long(), out], dim=1).to(ids.device)

    def _generation_config(self, given, kwargs: dict):
        """transformers' merge: ``given`` (else the export's generation config), its unset token
        ids from the export's, then the keyword arguments; what nxdc does not implement refused."""
        gen = copy.deepcopy(given if given is not None else self.generation_config)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(gen, name, None) is None:
                setattr(gen, name, getattr(self.generation_config, name, None))
        unused = gen.update(**kwargs)
        set_to = {k: getattr(gen, k, None) for k in NOT_IMPLEMENTED}
        off = {k: v for k, v in set_to.items() if v not in (None, NOT_IMPLEMENTED[k])}
        if unused or off:
            named = [*sorted(unused), *(f"{k}={v!r}" for k, v in off.items())]
            raise UserInputError(
                f"nxdc's generate does not implement {', '.join(named)} "
                "(it does greedy and temperature / top-k / top-p sampling)"
            )
        return gen

    def close(self) -> None:
        """Close the model (stops a --tp export's worker processes). Idempotent."""
        self.model.close()

    def __enter__(self) -> NxdcModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _get(gen, name: str):
    value = getattr(gen, name, None)
    return DEFAULTS[name] if value is None else value


def _id_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, list | tuple) else [int(ids)]


def _attention_mask(ids, mask, pad: int | None, eos: list[int]):
    """The mask given, else transformers' guess: the pad token's positions are padding when the
    pad token occurs and is not an EOS token."""
    import torch

    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != ids.shape:
            raise UserInputError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}"
            )
        return mask
    if pad is not None and pad not in eos and bool((ids == pad).any()):
        return ids != pad
    return torch.ones_like(ids)


def _run(steps, n: int, fill: int, streamer, sequence_length: int) -> list[list[int]]:
    """Each row's new tokens as transformers counts them (an ending EOS token included), the
    streamer given each step's tokens ([batch]; ``fill`` for rows already done)."""
    import torch

    new: list[list[int]] = [[] for _ in range(n)]
    outs = None
    for outs in steps:
        grown = []
        for i in range(n):
            eos = outs.ended_by[i]
            now = outs.out[i] + ([eos] if eos is not None else [])
            grown.append(now[len(new[i]) :])
            new[i] = now
        if streamer is not None:
            for j in range(max(len(g) for g in grown)):
                streamer.put(torch.tensor([g[j] if j < len(g) else fill for g in grown], dtype=torch.long))
    if streamer is not None:
        streamer.end()
    if outs is not None and any(s.cause == "max_seq" for s in outs.streams):
        log.warning("generation stopped at the export's sequence length, %d tokens", sequence_length)
    return new
