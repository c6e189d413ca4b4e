"""Expert banks and their dispatch.

- :mod:`~moelab.experts.protocol`: :class:`Experts`, what every bank implements.
- :mod:`~moelab.experts.base`: :class:`SparseExperts`, every bank's base: ``experts(x, routing)``
  runs each layout of a routing (plain, variable K, capacity padding, DenseMixer) once.
- :mod:`~moelab.experts.capacity`: expert capacity, the drop policies and the padded layout's C.
- :mod:`~moelab.experts.dispatch`: sort → gather → run → combine, written once
  (:func:`moelab.experts.dispatch.dispatch`; not re-exported, ``moelab.experts.dispatch`` is the module).
- :mod:`~moelab.experts.kernels`: the kernels by name (:data:`KERNELS`), functions of the experts'
  weight tensors (:class:`ExpertWeights`), and ``impl="auto"``'s rule (:func:`choose_kernel`).
- :mod:`~moelab.experts.tuning`: :func:`autotune`, the explicit measurement of ``auto``'s
  candidate kernels (no forward measures anything).
- :mod:`~moelab.experts.bank`: :class:`ExpertBank` (stacked-weight MLP experts) and :class:`MLP`.
- :mod:`~moelab.experts.modules`: :class:`ModuleExperts` (arbitrary modules, e.g. CNN experts).
- :mod:`~moelab.experts.parallel`: :class:`ExpertParallelBank` (experts across a process group).
"""

from .bank import MLP, ExpertBank
from .base import SparseExperts, check_bank
from .dispatch import Slots, combine, sort_slots
from .kernels import IMPLS, KERNELS, ExpertWeights, choose_kernel, grouped_mm_available
from .modules import ModuleExperts
from .parallel import ExpertParallelBank
from .protocol import Experts
from .tuning import AutotuneReport, autotune, forget_tuned

__all__ = [
    "IMPLS",
    "KERNELS",
    "MLP",
    "AutotuneReport",
    "ExpertBank",
    "ExpertParallelBank",
    "ExpertWeights",
    "Experts",
    "ModuleExperts",
    "Slots",
    "SparseExperts",
    "autotune",
    "check_bank",
    "choose_kernel",
    "combine",
    "forget_tuned",
    "grouped_mm_available",
    "sort_slots",
]
