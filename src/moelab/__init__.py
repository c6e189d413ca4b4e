"""moelab: sparse mixture-of-experts routing, every method of the source papers, correct and fast."""

from .experts import ExpertBank, ModuleExperts
from .interop import from_hf
from .layer import MoE, aux_loss
from .methods import methods
from .routing import Routing, RoutingContext, attach
from .schedules import CoinFlipSchedule, CompetitionSchedule
from .upcycle import upcycle

__version__ = "0.1.0"

__all__ = [
    "CoinFlipSchedule",
    "CompetitionSchedule",
    "ExpertBank",
    "MoE",
    "ModuleExperts",
    "Routing",
    "RoutingContext",
    "__version__",
    "attach",
    "aux_loss",
    "from_hf",
    "methods",
    "upcycle",
]
