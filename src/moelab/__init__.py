"""moelab: sparse mixture-of-experts routing, every method of the source papers, correct and fast."""

from ._version import __version__
from .experts import ExpertBank, ModuleExperts
from .hf import from_hf, set_method, to_hf, upcycle
from .io import load, load_weights, save
from .layer import MoE, attach, aux_loss, recording_routing, set_aux_scale
from .methods import methods
from .routing import Routing, RoutingContext
from .schedules import CoinFlipSchedule, CompetitionSchedule, routing_context

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
    "load",
    "load_weights",
    "methods",
    "recording_routing",
    "routing_context",
    "save",
    "set_aux_scale",
    "set_method",
    "to_hf",
    "upcycle",
]
