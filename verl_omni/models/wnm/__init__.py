"""WNM world-action model: joint video/action DiT, frozen encoders, complete checkpoints.

Public API (see docs/contracts.md and each module's docstring)::

    from verl_omni.models.wnm import (WNMConfig, WNMTransformer, WNMModel, WNMContext, load_wnm_checkpoint,
                                      save_wnm_checkpoint, read_checkpoint_contract, check_contract_compatibility)
"""

from .checkpoint import (
    CheckpointError,
    ContractMismatchError,
    ContractReport,
    check_contract_compatibility,
    contract_of,
    load_wnm_checkpoint,
    read_checkpoint_contract,
    save_wnm_checkpoint,
)
from .config import SIZES, WNMConfig
from .encoders import GeometryEncoder
from .model import EncoderSources, WNMModel, build_wnm_model
from .transformer import WNMContext, WNMTransformer

__all__ = [
    "SIZES",
    "CheckpointError",
    "ContractMismatchError",
    "ContractReport",
    "EncoderSources",
    "GeometryEncoder",
    "WNMConfig",
    "WNMContext",
    "WNMModel",
    "WNMTransformer",
    "build_wnm_model",
    "check_contract_compatibility",
    "contract_of",
    "load_wnm_checkpoint",
    "read_checkpoint_contract",
    "save_wnm_checkpoint",
]
