"""CONTRACT STAND-IN for trace/model_builder_utils.py: the artifact classes, with the same
constructor arguments (TraceArtifacts, CompilationArtifacts, ModelParamInfo, ProvidedArgInfo)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch_neuronx._standin_pickle import NoPickle


@dataclass
class ModelParamInfo:
    param_name: str
    is_positional: bool


@dataclass
class ProvidedArgInfo:
    param_name: str
    is_positional: bool
    tensor: torch.Tensor


class TraceArtifacts(NoPickle):
    def __init__(
        self,
        hlo,
        metaneff,
        flattener,
        packer,
        weight_name_to_idx,
        weight_names_to_skip,
        provided_args,
        model_params,
    ):
        self.hlo, self.metaneff, self.flattener, self.packer = hlo, metaneff, flattener, packer
        self.weight_name_to_idx = weight_name_to_idx
        self.weight_names_to_skip = weight_names_to_skip
        self.provided_args, self.model_params = provided_args, model_params


class CompilationArtifacts:
    def __init__(self, neff_filepath: str):
        self.neff_filepath = neff_filepath

    def get_neff_bytes(self) -> bytes:
        with open(self.neff_filepath, "rb") as f:
            return f.read()
