"""Weight storage formats (``--weights``), parsed and named in one place.

A format is a kind (fp32, fp16, bf16, int8, int4) and, for the integer kinds, how it is scaled:
per group of ``group`` consecutive inputs of a row (``-gG``; per row: int8 only), symmetric
(``-sym``) or with a per-group min (``-asym``: ``w = q * scale + min``). The plan stores the
canonical name:

- ``int8-g32`` / ``int8-g64`` ...: symmetric int8, one fp32 scale per group (``--weights int8`` = g32);
- ``int8``: int8 with one scale per output row (``--weights int8-row``; the name exports made
  before group scales carry, so it keeps that meaning);
- ``int4-asym-g32`` / ``int4-sym-g32`` ...: group-wise int4. ``--weights int4`` is asymmetric, g32
  (llama.cpp's Q4_1 / Q4_K form): on SmolLM2 it keeps the source's Q4_1 values exactly (top-1
  100%), where symmetric int4 (Q4_0's form) agrees with fp32 on 74% (docs/weights.md);
- ``int8-asym-gG``: int8 with a min per group (GGUF Q5_K's form);
- any of the group-wise names with ``-f16``: its scales (and mins) stored as fp16, not fp32, as
  llama.cpp's Q4_0 / Q4_1 / Q8_0 keep theirs: 16 bits a group less each. ``--weights int4`` is
  ``int4-asym-g32-f16`` (5 bits a weight, not 6; decode reads that much less); ``--weights int8``
  keeps fp32 scales (``int8-f16`` asks for fp16); ``-f32`` spells fp32 out. A GGUF's Q8_0 / Q4_0 /
  Q4_1 / Q5_0 / Q5_1 tensors load with fp16 scales (their own);
- ``-k``: two-level scales, as a GGUF K-quant (Q4_K, Q5_K, Q6_K) stores them: per group an int8
  factor, per 256 weights an fp16 factor, the group's scale their product (exact in fp32; a
  K-quant's scale is an fp16 times a 6-bit integer, which fp16 alone does not hold). Kept K-quant
  tensors load so (4.6 bits a weight for Q4_K, not 6), and ``--weights int4-k`` quantizes to it
  (``int4-asym-g32-k``: 4.6 bits where ``int4`` takes 5; every rank's inputs per row must be a
  multiple of 256, so not SmolLM2's 576; its embedding and lm_head keep fp16 scales);
- ``gguf``: each weight as its GGUF file stores it (``--weights auto`` on a GGUF source): the plan's
  ``weight_map`` names each module's format (``nxdc.weights.gguf_quant``); modules it leaves out
  are stored in the compute dtype.

No torch here: the planner validates formats without loading the model code."""

from __future__ import annotations

import re
from dataclasses import dataclass

FLOAT_KINDS = ("fp32", "fp16", "bf16")
DEFAULT_GROUP = 32
INT4_BLOCK = 32  # an int4 group is a whole number of 32-weight packed blocks
# What ``--weights`` accepts (plus the -gG / -asym spellings of the integer kinds)
CHOICES = ("fp32", "fp16", "bf16", "int8", "int8-row", "int4", "int4-sym", "auto")
AUTO = "auto"  # --weights auto: a GGUF source's own formats (GGUF), else the compute dtype
GGUF = "gguf"  # the plan's name for it
_NAME = re.compile(r"^(int8|int4)(-sym|-asym)?(?:-g(\d+))?(?:-(f16|f32|k))?$")
ASYM_DEFAULT = {"int8": False, "int4": True}
SCALES = {"f32": "", "f16": "-f16", "k": "-k"}  # how group scales are stored -> the name's suffix
SCALES_DEFAULT = {"int8": "f32", "int4": "f16"}  # --weights int4: fp16 scales; int8: fp32
SUPER = 256  # weights a super-block of two-level ("k") scales: GGUF's QK_K


@dataclass(frozen=True)
class WeightFormat:
    kind: str  # fp32 | fp16 | bf16 | int8 | int4
    group: int | None = None  # inputs per scale; None: per row (int8) or not quantized
    asym: bool = False  # a per-group min beside the scale
    scales: str = "f32"  # how group scales (and mins) are stored: f32 | f16 | k (SCALES)

    @property
    def quantized(self) -> bool:
        return self.kind in ("int8", "int4")

    @property
    def name(self) -> str:
        """The canonical name, as the plan (and the manifest) stores it."""
        if not self.quantized:
            return self.kind
        if self.group is None:
            return "int8"
        form = "-asym" if self.asym else ("-sym" if self.kind == "int4" else "")
        return f"{self.kind}{form}-g{self.group}{SCALES[self.scales]}"

    def check_inputs(self, k: int, what: str) -> str | None:
        """Why a weight with ``k`` inputs per row (per rank) cannot be stored so, or None."""
        if self.group is None or k % self.group == 0 and (self.scales != "k" or k % SUPER == 0):
            return None
        unit = SUPER if k % self.group == 0 else self.group
        return f"{what} has {k} inputs per row, which {unit}-weight {'super-blocks' if unit == SUPER else 'groups'} do not divide"


# Tables that int4 formats keep in int8 (groups of 32), as llama.cpp's 4-bit files keep their
# output at 6-8 bits: int4 there took SmolLM2's top-1 agreement with fp32 down by ~20 points.
INT8_TABLES = ("embed_tokens", "lm_head")


def module_format(name: str, module: str, weight_map: dict[str, str] | None = None) -> str | None:
    """The canonical format the Decoder submodule ``module`` stores its weight in, for the plan's
    format ``name`` (and, for ``gguf``, its ``weight_map``); None: the compute dtype."""
    if name == GGUF:
        return (weight_map or {}).get(module)
    f = parse(name)
    if f.kind == "int4" and module.split(".")[0] in INT8_TABLES:  # (a lookup reads no two-level scales)
        return WeightFormat("int8", DEFAULT_GROUP, scales="f16" if f.scales == "k" else f.scales).name
    return name


def quantized(name: str | None) -> bool:
    """Whether a plan's weight format stores integers (some of them, for ``gguf``)."""
    return name == GGUF or (name is not None and parse(name).quantized)


def parse(name: str) -> WeightFormat:
    """A canonical name (as plans store them) -> its format; ValueError for anything else."""
    if name in FLOAT_KINDS:
        return WeightFormat(name)
    if name == "int8":
        return WeightFormat("int8")
    m = _NAME.match(name)
    if not m or m.group(3) is None or m.group(4) == "f32":
        raise ValueError(f"not a weight format: {name!r}")
    f = _checked(m.group(1), int(m.group(3)), _asym(m), m.group(4) or "f32", name)
    if f.name != name:
        raise ValueError(f"not a canonical weight format: {name!r} (is {f.name!r})")
    return f


def from_user(value: str) -> WeightFormat:
    """``--weights`` -> its format: ``int8`` and ``int4`` mean group 32 (int4 with fp16 scales and
    mins, int8 with fp32 scales: ``-f16`` / ``-f32`` choose, ``-k`` for int4), ``int8-row`` one scale per row.
    ValueError with a one-line reason for anything else."""
    if value in FLOAT_KINDS:
        return WeightFormat(value)
    if value == "int8-row":
        return WeightFormat("int8")
    m = _NAME.match(value)
    if not m:
        raise ValueError(
            f"--weights must be one of {', '.join(CHOICES)} (int8 / int4 also as -gG, e.g. int4-g128, and "
            f"-f16 / -f32 / -k for how scales are stored, e.g. int4-f32), got {value!r}"
        )
    if m.group(1) == "int8" and m.group(2) == "-asym":
        raise ValueError("--weights int8-asym is not a choice: int8's 255 levels gain nothing from a min")
    if m.group(1) == "int8" and m.group(4) == "k":  # its embedding would need them in a lookup
        raise ValueError(f"--weights {value}: two-level (-k) scales are for int4 (int4-k)")
    group = int(m.group(3)) if m.group(3) else DEFAULT_GROUP
    return _checked(m.group(1), group, _asym(m), m.group(4) or SCALES_DEFAULT[m.group(1)], value)


def _asym(m: re.Match) -> bool:
    return m.group(2) == "-asym" if m.group(2) else ASYM_DEFAULT[m.group(1)]


def _checked(kind: str, group: int, asym: bool, scales: str, value: str) -> WeightFormat:
    unit = INT4_BLOCK if kind == "int4" else 16  # the kernels' vectors never straddle a group
    if group <= 0 or group % unit:
        raise ValueError(f"--weights {value}: the {kind} group size must be a positive multiple of {unit}")
    if scales == "k" and SUPER % group:
        raise ValueError(f"{value}: two-level scales need groups that divide {SUPER} weights")
    return WeightFormat(kind, group, asym, scales)
