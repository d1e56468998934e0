from tfm_runtime.models.dflash import DFlashConfig, DFlashDrafter
from tfm_runtime.models.target import TargetModel, TargetOutput, default_tap_layers
from tfm_runtime.models.weaver import Weaver, WeaverConfig

__all__ = ["DFlashConfig", "DFlashDrafter", "TargetModel", "TargetOutput", "Weaver", "WeaverConfig",
           "default_tap_layers"]
